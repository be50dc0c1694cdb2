// Memory: what the metrics carry, and memory caps derived from measured memory before
// any out-of-memory error (hddp/balance/memory_model.h, docs/balance.md).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "hddp/balance/memory_model.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/emulated_device.h"
#include "support/ranks.h"
#include "train/memory_meter.h"

namespace {

using hddp::MemoryEstimator;
using hddp::MemoryObservation;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

MemoryObservation observed(int64_t samples, double base, double peak, double total,
                           double other = 0) {
  MemoryObservation o;
  o.samples = samples;
  o.baseBytes = base;
  o.peakBytes = peak;
  o.totalBytes = total;
  o.otherBytes = other;
  return o;
}

// One size: fixed = the base, per sample = (peak - base) / b. With 10% of 1000 kept
// free and 50 held by others: (1000 * 0.9 - 50 - 200) / 12 = 54.17 -> 54.
TEST(Memory, OneSizeGivesTheLineThroughTheBaseAndThePeak) {
  MemoryEstimator m;
  EXPECT_EQ(m.cap(0.1), kNone) << "nothing measured";
  m.record(observed(24, 200, 200 + 12 * 24, 1000, 50));
  m.record(observed(0, 200, 200, 1000, 50));  // no samples: ignored
  const auto f = m.fit();
  EXPECT_EQ(f.steps, 1);
  EXPECT_DOUBLE_EQ(f.fixedBytes, 200);
  EXPECT_DOUBLE_EQ(f.perSampleBytes, 12);
  EXPECT_EQ(m.cap(0.1), 54);
  EXPECT_EQ(m.cap(0.0), 62);  // (1000 - 50 - 200) / 12 = 62.5
}

// Several sizes: the line through the peaks, robust to one odd step (a workspace the
// allocator grabbed once). Peaks 100 + 10 b at b = 10, 20, 30, 40 and one step at
// b = 25 that peaked 400 higher: the median slope is still 10, the intercept 100.
TEST(Memory, SeveralSizesFitTheLineThroughThePeaksRobustly) {
  MemoryEstimator m;
  for (int64_t b : {10, 20, 30, 40}) {
    m.record(observed(b, 999, 100 + 10.0 * b, 2000));  // the base is not used here
  }
  m.record(observed(25, 999, 100 + 10.0 * 25 + 400, 2000));
  const auto f = m.fit();
  EXPECT_NEAR(f.perSampleBytes, 10, 1e-9);
  EXPECT_NEAR(f.fixedBytes, 100, 1e-9);
  EXPECT_EQ(m.cap(0.1), 170);  // (1800 - 100) / 10
  // Memory that does not grow with the batch gives no cap.
  MemoryEstimator flat;
  flat.record(observed(8, 500, 500, 1000));
  flat.record(observed(16, 500, 500, 1000));
  EXPECT_EQ(flat.cap(0.1), kNone);
  // A budget the fixed part already exceeds: a cap of 0 samples.
  MemoryEstimator full;
  full.record(observed(8, 950, 990, 1000));
  EXPECT_EQ(full.cap(0.1), 0);
}

TEST(Memory, EmulatedMemoryParsesAndRefusesBadItems) {
  hddp::EmulationOptions o;
  hddp::parseEmulatedMemory("V", "0:10+1/100,1:200+12.5/1000", 2, 1, o);
  EXPECT_DOUBLE_EQ(o.memoryFixedBytes, 200 * kMiB);
  EXPECT_DOUBLE_EQ(o.memoryPerSampleBytes, 12.5 * kMiB);
  EXPECT_DOUBLE_EQ(o.memoryTotalBytes, 1000 * kMiB);
  auto error = [](const std::string& text) {
    hddp::EmulationOptions e;
    try {
      hddp::parseEmulatedMemory("HDDP_EMULATE_MEMORY", text, 2, 0, e);
    } catch (const hddp::ConfigError& err) {
      return std::string(err.what_without_backtrace());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(error("1:200/1000").find("is not rank:FIXED+PER_SAMPLE/TOTAL"), std::string::npos);
  EXPECT_NE(error("2:1+1/10").find("names rank 2, but this job has 2"), std::string::npos);
  EXPECT_NE(error("0:100+1/50").find("a TOTAL above FIXED"), std::string::npos);
  EXPECT_NE(error("0:1+0/50").find("PER_SAMPLE > 0"), std::string::npos);
  EXPECT_NE(error("0:x+1/50").find("HDDP_EMULATE_MEMORY"), std::string::npos);
}

// The emulated reading is exact, and a step that needs more than the device throws
// as a card out of memory does.
TEST(Memory, TheEmulatedDeviceReadsItsLineAndRunsOutAboveItsTotal) {
  hddp::EmulationOptions e;
  e.memoryFixedBytes = 100 * kMiB;
  e.memoryPerSampleBytes = 12 * kMiB;
  e.memoryTotalBytes = 500 * kMiB;
  hddp::train::MemoryMeter meter(c10::Device(c10::kCPU), e);
  meter.beginStep();
  const auto r = meter.endStep(20);
  EXPECT_TRUE(r.emulated);
  EXPECT_DOUBLE_EQ(r.peakBytes, 340 * kMiB);
  EXPECT_DOUBLE_EQ(r.observation(20).baseBytes, 100 * kMiB);
  hddp::Emulator emulator(e);
  EXPECT_NO_THROW(emulator.checkMemory(33));                      // 496 MiB
  EXPECT_THROW(emulator.checkMemory(34), c10::OutOfMemoryError);  // 508 MiB
  // A CPU rank reads its resident set and gives the planner nothing to derive from.
  hddp::train::MemoryMeter cpu(c10::Device(c10::kCPU), {});
  cpu.beginStep();
  const auto c = cpu.endStep(20);
  EXPECT_GT(c.residentBytes, 10 * kMiB);
  EXPECT_EQ(c.observation(20).samples, 0);
}

// On a device the allocator's peak follows what the step allocated, through the
// device-generic allocator interface; the device's total and the others' use are read.
void allocatorReadingFollowsTheStep(const c10::Device& device, double minTotalBytes) {
  at::Tensor held = torch::ones({1 << 20}, torch::TensorOptions().device(device));  // 4 MiB
  hddp::train::MemoryMeter meter(device, {});
  for (int64_t mib : {16, 64}) {
    meter.beginStep();
    {
      at::Tensor step = torch::empty({mib << 18}, torch::TensorOptions().device(device));
      step.fill_(1.0f);
    }  // freed before the reading, as activations are by the step's end
    const auto r = meter.endStep(mib);
    EXPECT_TRUE(r.device);
    EXPECT_FALSE(r.emulated);
    EXPECT_GE(r.baseBytes, 4 * kMiB) << "the held tensor";
    EXPECT_GE(r.peakBytes, r.baseBytes + mib * kMiB) << mib << " MiB step";
    EXPECT_LT(r.peakBytes, r.baseBytes + (mib + 4) * kMiB) << mib << " MiB step";
    EXPECT_GE(r.reservedPeakBytes, r.peakBytes);
    EXPECT_GE(r.totalBytes, minTotalBytes);
    EXPECT_GE(r.otherBytes, 0.0);
    std::printf(
        "%lld MiB step: base %.1f MiB, peak %.1f MiB, reserved %.1f MiB of %.1f MiB, "
        "others %.1f MiB\n",
        static_cast<long long>(mib), r.baseBytes / kMiB, r.peakBytes / kMiB,
        r.reservedPeakBytes / kMiB, r.totalBytes / kMiB, r.otherBytes / kMiB);
  }
}

TEST(Memory, TheAllocatorReadingFollowsTheStep_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  allocatorReadingFollowsTheStep(c10::Device(c10::kCUDA, 0), 1024 * kMiB);
}

// emu's allocator, behind the same interface, with a total the test sets.
TEST(Memory, TheAllocatorReadingFollowsTheStep_Emu) {
  const c10::Device device = hddp::testing::emulatedDevice(1);
  hddp::emu::setMemoryTotal(1, int64_t{512} << 20);
  allocatorReadingFollowsTheStep(device, 512 * kMiB);
  EXPECT_EQ(hddp::train::MemoryMeter(device, {}).endStep(1).totalBytes, 512 * kMiB);
}

// Rank 1's memory reads 100 MiB + 12 MiB per sample of a 500 MiB device: 35 samples
// or more do not fit (520 MiB), and with 10% kept free its cap is
// floor((450 - 100) / 12) = 29. Rank 0 is much slower, so the planner wants to give
// rank 1 nearly all of the 48. The cap is derived from the steps at the equal split
// (24 each, 388 MiB): no step runs out of memory, and rank 1 never gets more than 29.
// Without the derivation the plan goes to 36+ and a step fails (checked by turning
// the exchange of derived caps off).
TEST(Memory, TheCapIsDerivedBeforeAnyOutOfMemoryAndThePlanKeepsToIt) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<hddp::TrainSummary> summaries(2);
  std::vector<std::vector<int64_t>> derived(2);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 16), torch::nn::ReLU(),
                                torch::nn::Linear(16, 4));
    torch::optim::SGD opt(model->parameters(), 0.05);
    hddp::TrainerOptions o;
    o.globalBatch = 48;
    o.epochs = 2;
    o.progress = hddp::ProgressMode::Off;
    o.metricsPath = dir + "/metrics.jsonl";
    o.seedPlan = false;  // the equal split first
    o.planner.rebalanceEvery = 5;
    hddp::EmulationOptions e;
    if (rank == 1) {
      e.memoryFixedBytes = 100 * kMiB;
      e.memoryPerSampleBytes = 12 * kMiB;
      e.memoryTotalBytes = 500 * kMiB;
    }
    o.emulation = e;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(960, 1, 8, 4);
    auto forward = [&model, rank](const at::Tensor& x) {
      if (rank == 0) {  // 1 ms per sample: rank 1 is many times faster
        std::this_thread::sleep_for(std::chrono::microseconds(1000 * x.size(0)));
      }
      return model->forward(x);
    };
    hddp::Trainer trainer(*comm, model.ptr(), forward, hddp::crossEntropy(), opt, ds, o);
    summaries[rank] = trainer.fit();
    derived[rank] = trainer.planner()->derivedMemoryCaps();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(summaries[r].repeatedSteps, 0) << "rank " << r << " repeated a step";
    ASSERT_EQ(derived[r].size(), 2u);
    EXPECT_EQ(derived[r][0], kNone) << "rank 0 measures no device memory (a CPU rank)";
    EXPECT_EQ(derived[r][1], 29) << "rank " << r;
  }
  EXPECT_DOUBLE_EQ(summaries[1].peakMemoryBytes, (100 + 12 * 29) * kMiB);
  EXPECT_GT(summaries[0].peakMemoryBytes, 10 * kMiB);  // rank 0's resident set
  int atCap = 0;
  int outOfMemory = 0;
  bool epochPeak = false;
  std::ifstream in(dir + "/metrics.rank1.jsonl");
  ASSERT_TRUE(in.good());
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.at("kind") == "out_of_memory") {
      ++outOfMemory;
    } else if (j.at("kind") == "step") {
      const int64_t local = j.at("local_batch");
      EXPECT_LE(local, 29) << line;
      atCap += local == 29 ? 1 : 0;
      const auto& m = j.at("memory");
      EXPECT_EQ(m.at("emulated"), true) << line;
      EXPECT_DOUBLE_EQ(m.at("peak_allocated_bytes").get<double>(), (100 + 12.0 * local) * kMiB);
      EXPECT_DOUBLE_EQ(m.at("total_bytes").get<double>(), 500 * kMiB);
    } else if (j.at("kind") == "epoch") {
      epochPeak = j.contains("peak_memory_bytes");
    }
  }
  EXPECT_EQ(outOfMemory, 0);
  EXPECT_GT(atCap, 10) << "the cap should bind: rank 1 is the fast one";
  EXPECT_TRUE(epochPeak);
}

}  // namespace
