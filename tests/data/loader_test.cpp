// The prefetching loader: order, exactly-once under plan changes, errors, stopping,
// resume, and (on a GPU) the side-stream copy overlapping compute.
#include "hddp/data/loader.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include "hddp/balance/batch_plan.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "support/emulated_device.h"

namespace {

// Images whose pixels encode the index; augmentation so the per-sample RNG matters.
std::shared_ptr<hddp::ImageClassificationDataset> indexImages(int64_t n) {
  auto images = at::arange(n, at::kLong)
                    .remainder(251)
                    .to(at::kByte)
                    .view({n, 1, 1, 1})
                    .expand({n, 1, 8, 8})
                    .contiguous();
  auto labels = at::arange(n, at::kLong).remainder(10);
  auto ds = std::make_shared<hddp::ImageClassificationDataset>(images, labels, 10, "index images");
  hddp::ImageTransform t;
  t.padCrop = 2;
  t.horizontalFlip = true;
  ds->setTransform(t);
  return ds;
}

hddp::BatchPlan plan(std::vector<int64_t> local) {
  hddp::BatchPlan p;
  p.local = std::move(local);
  for (auto b : p.local) {
    p.global += b;
  }
  return p;
}

struct Seen {
  std::vector<std::vector<int64_t>> indices;
  std::vector<at::Tensor> inputs;
};

Seen drain(hddp::PrefetchLoader& loader) {
  Seen seen;
  while (auto b = loader.next()) {
    seen.indices.push_back(b->share.indices);
    seen.inputs.push_back(b->input);
  }
  return seen;
}

// Fails for one index; optionally slow.
class FlakyDataset : public hddp::Dataset {
 public:
  FlakyDataset(int64_t n, int64_t bad, std::chrono::milliseconds delay = {})
      : n_(n), bad_(bad), delay_(delay) {}
  int64_t size() const override { return n_; }
  hddp::Example get(int64_t index, hddp::SampleRng&) const override {
    ++calls;
    if (delay_.count() > 0) {
      std::this_thread::sleep_for(delay_);
    }
    if (index == bad_) {
      throw std::runtime_error("corrupt record");
    }
    return {at::full({2}, static_cast<float>(index)), at::scalar_tensor(index % 3, at::kLong)};
  }
  mutable std::atomic<int64_t> calls{0};

 private:
  int64_t n_;
  int64_t bad_;
  std::chrono::milliseconds delay_;
};

}  // namespace

TEST(Loader, SameBatchesWhateverTheWorkerCount) {
  auto ds = indexImages(100);
  std::vector<Seen> runs;
  for (int workers : {0, 1, 3}) {
    hddp::LoaderOptions o;
    o.workers = workers;
    o.depth = 3;
    o.seed = 42;
    o.sampler.seed = 7;
    hddp::PrefetchLoader loader(ds, /*rank=*/1, o);
    loader.startEpoch(2, plan({10, 6}));
    runs.push_back(drain(loader));
  }
  ASSERT_EQ(runs[0].indices.size(), 7u);  // 100 / 16, last partial step kept
  for (size_t r = 1; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].indices, runs[0].indices);
    for (size_t i = 0; i < runs[0].inputs.size(); ++i) {
      EXPECT_TRUE(at::equal(runs[r].inputs[i], runs[0].inputs[i])) << "workers run " << r;
    }
  }
  // Augmentation really ran (crops/flips make some pixels zero-padding).
  EXPECT_GT((runs[0].inputs[0] == 0).sum().item<int64_t>(), 0);
}

TEST(Loader, EverySampleOnceAcrossRanksWhenThePlanChangesMidEpoch) {
  auto ds = indexImages(203);
  hddp::LoaderOptions o;
  o.workers = 2;
  o.depth = 4;
  std::vector<std::unique_ptr<hddp::PrefetchLoader>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(std::make_unique<hddp::PrefetchLoader>(ds, r, o));
    ranks.back()->startEpoch(0, plan({10, 10, 10}));
  }
  std::multiset<int64_t> used;
  int step = 0;
  for (;;) {
    bool any = false;
    for (auto& l : ranks) {
      if (auto b = l->next()) {
        any = true;
        used.insert(b->share.indices.begin(), b->share.indices.end());
      }
    }
    if (!any) {
      break;
    }
    ++step;
    if (step == 2) {  // batches for steps 3.. were already prepared under the old plan
      for (auto& l : ranks) {
        l->setPlan(plan({25, 3, 2}));
      }
    }
    if (step == 5) {
      for (auto& l : ranks) {
        l->setPlan(plan({1, 0, 40}));
      }
    }
  }
  ASSERT_EQ(used.size(), 203u);
  for (int64_t i = 0; i < 203; ++i) {
    EXPECT_EQ(used.count(i), 1u) << "sample " << i;
  }
}

TEST(Loader, WorkerErrorSurfacesWithTheSampleIndexInOrder) {
  auto ds = std::make_shared<FlakyDataset>(40, /*bad=*/13);
  hddp::LoaderOptions o;
  o.workers = 3;
  o.depth = 4;
  o.sampler.shuffle = false;
  hddp::PrefetchLoader loader(ds, 0, o);
  loader.startEpoch(0, plan({5}));
  // Steps 0 and 1 (samples 0-9) are fine, step 2 holds sample 13.
  ASSERT_TRUE(loader.next());
  ASSERT_TRUE(loader.next());
  try {
    loader.next();
    FAIL() << "expected a DataError";
  } catch (const hddp::DataError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("loading sample 13"), std::string::npos) << message;
    EXPECT_NE(message.find("step 2"), std::string::npos) << message;
    EXPECT_NE(message.find("corrupt record"), std::string::npos) << message;
  }
}

TEST(Loader, StoppingMidEpochJoinsBlockedWorkers) {
  auto ds = std::make_shared<FlakyDataset>(10000, -1, std::chrono::milliseconds(1));
  hddp::LoaderOptions o;
  o.workers = 4;
  o.depth = 2;
  {
    hddp::PrefetchLoader loader(ds, 0, o);
    loader.startEpoch(0, plan({8}));
    ASSERT_TRUE(loader.next());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // workers fill the queue
  }  // destructor joins them; a hang here fails the test by timeout
  const int64_t calls = ds->calls.load();
  EXPECT_LT(calls, 10000);  // it really stopped early
  hddp::PrefetchLoader stopped(ds, 0, o);
  stopped.startEpoch(0, plan({8}));
  stopped.stop();
  EXPECT_THROW(stopped.next(), hddp::Error);
}

TEST(Loader, ResumeContinuesWithTheNextBatch) {
  auto ds = indexImages(64);
  hddp::LoaderOptions o;
  o.workers = 2;
  o.seed = 3;
  hddp::PrefetchLoader first(ds, 0, o);
  first.startEpoch(1, plan({4, 4}));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(first.next());
  }
  const auto state = first.state();
  EXPECT_EQ(state.epoch, 1);
  EXPECT_EQ(state.position, 24);
  auto expected = first.next();
  hddp::PrefetchLoader second(ds, 0, o);
  second.resume(state, plan({4, 4}));
  auto got = second.next();
  ASSERT_TRUE(expected && got);
  EXPECT_EQ(got->share.indices, expected->share.indices);
  EXPECT_TRUE(at::equal(got->input, expected->input));
  EXPECT_EQ(got->stepInEpoch, 3);
  // The rest of the epoch too, including the last partial step.
  auto rest = drain(first);
  auto restResumed = drain(second);
  ASSERT_EQ(restResumed.indices, rest.indices);
  ASSERT_FALSE(rest.indices.empty());
}

TEST(Loader, ResumeAtAnUnevenEndOfEpoch) {
  auto ds = indexImages(80);
  for (int rank = 0; rank < 2; ++rank) {
    hddp::PrefetchLoader straight(ds, rank, {});
    straight.startEpoch(1, plan({12, 12}));
    ASSERT_TRUE(straight.next());
    ASSERT_TRUE(straight.next());
    hddp::PrefetchLoader resumed(ds, rank, {});
    resumed.resume(straight.state(), plan({12, 12}));
    auto a = drain(straight);
    auto b = drain(resumed);
    ASSERT_EQ(a.indices.size(), 2u);
    EXPECT_EQ(a.indices, b.indices);
    EXPECT_EQ(a.indices[1].size(), 4u);
  }
}

TEST(Loader, ZeroShareStepsAndDataWait) {
  auto ds = std::make_shared<FlakyDataset>(20, -1, std::chrono::milliseconds(20));
  hddp::LoaderOptions o;
  o.workers = 1;
  hddp::PrefetchLoader loader(ds, 1, o);
  loader.startEpoch(0, plan({5, 0}));
  auto b = loader.next();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->share.localBatch, 0);
  EXPECT_FALSE(b->input.defined());
  EXPECT_EQ(b->share.globalBatch, 5);
  hddp::PrefetchLoader slow(ds, 0, o);
  slow.startEpoch(0, plan({5, 0}));
  auto first = slow.next();
  ASSERT_TRUE(first);
  EXPECT_GT(first->waitSeconds, 0.0);  // 5 samples x 20 ms were not ready yet
  EXPECT_EQ(first->bytes, 5 * 2 * 4 + 5 * 8);
}

TEST(Loader, BadOptionsAreRefused) {
  auto ds = indexImages(8);
  hddp::LoaderOptions o;
  o.depth = 0;
  EXPECT_THROW(hddp::PrefetchLoader(ds, 0, o), hddp::ConfigError);
  hddp::PrefetchLoader loader(ds, 0, {});
  EXPECT_THROW(loader.next(), hddp::Error);  // before startEpoch
  loader.startEpoch(0, plan({4, 4}));
  EXPECT_THROW(hddp::PrefetchLoader(ds, 3, {}).startEpoch(0, plan({4, 4})), hddp::ConfigError);
}

// ---- CUDA -----------------------------------------------------------------------------

// Batches on a device equal the host's, copied on the loader's side stream.
void deviceBatchesMatchHostBatches(const c10::Device& dev) {
  auto ds = indexImages(50);
  hddp::LoaderOptions o;
  o.workers = 2;
  hddp::PrefetchLoader host(ds, 0, o);
  o.device = dev;
  hddp::PrefetchLoader device(ds, 0, o);
  host.startEpoch(0, plan({8}));
  device.startEpoch(0, plan({8}));
  while (auto h = host.next()) {
    auto d = device.next();
    ASSERT_TRUE(d);
    EXPECT_EQ(d->input.device(), dev);
    EXPECT_TRUE(at::equal(d->input.cpu(), h->input));
    EXPECT_TRUE(at::equal(d->target.cpu(), h->target));
  }
  EXPECT_FALSE(device.next());
}

TEST(Loader, DeviceBatchesMatchHostBatches_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  deviceBatchesMatchHostBatches(c10::Device(c10::kCUDA, 0));
}

// On emu the side-stream copy runs later, on the stream's own thread, and a use that
// is not ordered after it throws: the batches are right only if the loader makes the
// compute stream wait for its copy (and records the batch on it).
TEST(Loader, DeviceBatchesMatchHostBatches_Emu) {
  const c10::Device dev = hddp::testing::emulatedDevice(0);
  hddp::emu::setStreamDelay(std::chrono::milliseconds(5));
  deviceBatchesMatchHostBatches(dev);
  hddp::emu::checkNoViolations();
}

// The copy of the next batch is queued on the side stream when next() returns the
// current one (pinned memory: an asynchronous copy) and runs while the host computes
// on the current batch: the next next() finds it done. Each queued copy waits 200 ms,
// so without the overlap the second next() would wait >= 400 ms (input and target).
TEST(Loader, CopyOverlapsCompute_Emu) {
  const c10::Device dev = hddp::testing::emulatedDevice(0);
  auto ds = indexImages(64);
  hddp::LoaderOptions o;
  o.workers = 2;
  o.depth = 2;
  o.device = dev;
  hddp::PrefetchLoader loader(ds, 0, o);
  loader.startEpoch(0, plan({16}));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // batches 0 and 1 on the host
  hddp::emu::setStreamDelay(std::chrono::milliseconds(200));
  auto batch0 = loader.next();  // batch 0 copied; batch 1's copy queued on the side stream
  ASSERT_TRUE(batch0 && batch0->copied);
  std::this_thread::sleep_for(std::chrono::milliseconds(900));  // the host "computes"
  const auto before = std::chrono::steady_clock::now();
  auto batch1 = loader.next();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count();
  ASSERT_TRUE(batch1 && batch1->copied);
  EXPECT_LT(waited, 0.3) << "batch 1's copy did not run while the host computed";
  EXPECT_EQ(batch1->input.device(), dev);
  EXPECT_EQ(batch1->input.size(0), 16);
  hddp::emu::setStreamDelay(std::chrono::milliseconds(0));
  hddp::emu::checkNoViolations();
}

TEST(Loader, CopyOverlapsCompute_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const c10::Device dev(c10::kCUDA, 0);
  // 16 samples of 4 MiB: a 64 MiB batch, copied from pinned memory.
  auto images = at::zeros({64, 4, 512, 512}, at::kByte);
  auto ds = std::make_shared<hddp::ImageClassificationDataset>(images, at::zeros({64}, at::kLong),
                                                               10, "big");
  hddp::LoaderOptions o;
  o.workers = 2;
  o.depth = 2;
  o.device = dev;
  hddp::PrefetchLoader loader(ds, 0, o);
  loader.startEpoch(0, plan({16}));
  std::this_thread::sleep_for(std::chrono::seconds(2));  // batches 0 and 1 prepared on the host
  auto a = at::randn({8192, 8192}, at::TensorOptions().device(dev));
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  for (int i = 0; i < 40; ++i) {  // keep the compute stream busy for a while
    a = at::tanh(at::mm(a, a));
  }
  c10::Event computeDone(c10::kCUDA);
  computeDone.record(impl.getStream(dev));
  auto batch0 = loader.next();  // copies batch 0 and starts batch 1's copy on the side stream
  ASSERT_TRUE(batch0 && batch0->copied);
  bool copyFinishedWhileComputing = false;
  while (!computeDone.query()) {
    if (batch0->copied->query()) {
      copyFinishedWhileComputing = true;
      break;
    }
  }
  EXPECT_TRUE(copyFinishedWhileComputing)
      << "the side-stream copy did not complete while the compute stream was busy";
  computeDone.synchronize();
  auto batch1 = loader.next();
  ASSERT_TRUE(batch1);
  EXPECT_TRUE(batch1->input.is_cuda());
  EXPECT_EQ(batch1->input.size(0), 16);
}
