// A LibTorch program as the tutorials write it (pytorch/examples' cpp/mnist: a module
// held by value, a torch::data dataset with its transforms, make_data_loader), ported to
// hddp with what a port needs and nothing else: the module passed to DDP as it is, the
// loader's sampler swapped for hddp::PlanSampler, the reported loss from
// hddp::globalMeanLoss. Two ranks with unequal, changing shares train exactly as one
// rank on the whole batch (float64). Also the forms of module DDP accepts, the global
// mean with a rank that has no samples, and an allreduce of a temporary.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hddp/balance/cost_model.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/global_mean.h"
#include "hddp/core/error.h"
#include "hddp/data/plan_sampler.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

constexpr int64_t kSamples = 100;     // 6 steps of 16 per epoch, then one of 4
constexpr int64_t kGlobalBatch = 16;  // the batch_size of the single-device program
constexpr int kEpochs = 2;

// The tutorial's network, smaller: images of 1x3x4 pixels, 3 classes.
struct Net : torch::nn::Module {
  Net() : fc1(12, 16), fc2(16, 3) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1->forward(x.view({-1, 12})));
    return torch::log_softmax(fc2->forward(x), /*dim=*/1);
  }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

// A torch::data dataset, as the tutorial's MNIST: an image and its label per index.
class Images : public torch::data::datasets::Dataset<Images> {
 public:
  Images(torch::Tensor images, torch::Tensor labels)
      : images_(std::move(images)), labels_(std::move(labels)) {}
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {images_[i], labels_[i]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(images_.size(0)); }

 private:
  torch::Tensor images_, labels_;
};

struct TrainingSetup {
  torch::Tensor images, labels;
  std::vector<torch::Tensor> initial;  // the parameters every run starts from
};

TrainingSetup makeSetup() {
  torch::manual_seed(3);
  TrainingSetup s;
  s.images = torch::rand({kSamples, 1, 3, 4}, torch::kDouble);
  const torch::Tensor teacher = torch::randn({12, 3}, torch::kDouble);
  s.labels = (s.images.view({kSamples, 12}) - 0.5).matmul(teacher).argmax(1);
  Net net;
  net.to(torch::kDouble);
  for (const auto& p : net.parameters()) {
    s.initial.push_back(p.detach().clone());
  }
  return s;
}

struct RunResult {
  std::vector<double> losses;             // the global mean loss of each step
  std::vector<int64_t> localBatches;      // this rank's share of each step
  std::vector<torch::Tensor> parameters;  // at the end
};

// The tutorial's training loop, ported. Rank 1 is three times slower than rank 0 in the
// planner's initial costs (so the split is unequal), and after step 2 rank 0's memory
// cap of 5 samples re-plans within the epoch.
RunResult trainTutorialStyle(hddp::Communicator& comm, const TrainingSetup& setup, int workers) {
  Net model;
  model.to(torch::kDouble);
  if (comm.rank() == 0) {
    torch::NoGradGuard noGrad;
    auto params = model.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].copy_(setup.initial[i]);
    }
  }
  hddp::DistributedDataParallel ddp(model, comm);  // the module itself: broadcasts rank 0's
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.2).momentum(0.5));

  hddp::PlannerOptions po(kGlobalBatch);
  po.minLocalBatch = 1;
  std::vector<hddp::RankCost> costs(static_cast<size_t>(comm.size()));
  for (size_t r = 0; r < costs.size(); ++r) {
    costs[r].secondsPerSample = r == 0 ? 1e-3 : 3e-3;
  }
  hddp::BatchPlanner planner(comm, po, costs);
  hddp::PlanSampler sampler(kSamples, planner, comm.rank());

  auto dataset = Images(setup.images, setup.labels)
                     .map(torch::data::transforms::Normalize<>(0.5, 0.25))
                     .map(torch::data::transforms::Stack<>());
  auto loader = torch::data::make_data_loader(std::move(dataset), sampler,
                                              torch::data::DataLoaderOptions()
                                                  .batch_size(kGlobalBatch)
                                                  .workers(static_cast<size_t>(workers)));

  RunResult result;
  int step = 0;
  for (int epoch = 0; epoch < kEpochs; ++epoch) {
    for (auto& batch : *loader) {
      const hddp::StepShare share = sampler.stepOfBatch();
      EXPECT_EQ(batch.data.size(0), share.localBatch);
      ddp.setBatch(share.localBatch, share.globalBatch);
      optimizer.zero_grad();
      auto output = model.forward(batch.data);
      auto loss = torch::nll_loss(output, batch.target);
      loss.backward();
      optimizer.step();
      result.losses.push_back(hddp::globalMeanLoss(comm, loss, share.localBatch));
      result.localBatches.push_back(share.localBatch);
      if (++step == 2 && comm.size() > 1) {
        EXPECT_TRUE(planner.setMemoryCap(0, 5)) << "the plan must change within the epoch";
      }
    }
  }
  for (const auto& p : model.parameters()) {
    result.parameters.push_back(p.detach().clone());
  }
  return result;
}

TEST(TutorialPort, TwoRanksWithUnequalChangingSharesTrainAsOneRankOnTheWholeBatch) {
  const TrainingSetup setup = makeSetup();
  RunResult single;
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    single = trainTutorialStyle(*comm, setup, /*workers=*/0);
  });
  ASSERT_EQ(single.losses.size(), static_cast<size_t>(kEpochs * 7));
  const auto epochLoss = [&](int epoch) {  // the mean over the epoch's steps
    double sum = 0;
    for (int s = 0; s < 7; ++s) {
      sum += single.losses[static_cast<size_t>(epoch * 7 + s)];
    }
    return sum / 7;
  };
  EXPECT_LT(epochLoss(1), epochLoss(0)) << "the program trains";

  for (int workers : {0, 2}) {
    std::vector<RunResult> ranks(2);
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      ranks[static_cast<size_t>(rank)] = trainTutorialStyle(*comm, setup, workers);
    });
    const auto& shares = ranks[0].localBatches;
    ASSERT_EQ(shares.size(), single.losses.size()) << "workers " << workers;
    EXPECT_EQ(shares[0], 12) << "the planner's unequal split (rank 1 is 3x slower)";
    EXPECT_NE(std::find(shares.begin(), shares.end(), 5), shares.end())
        << "the re-planned split after the memory cap";
    for (size_t s = 0; s < single.losses.size(); ++s) {
      EXPECT_NEAR(ranks[0].losses[s], single.losses[s], 1e-12) << "step " << s;
      EXPECT_EQ(ranks[0].losses[s], ranks[1].losses[s]) << "step " << s;
    }
    double largest = 0;
    for (size_t i = 0; i < single.parameters.size(); ++i) {
      for (const auto& r : ranks) {
        largest =
            std::max(largest, (r.parameters[i] - single.parameters[i]).abs().max().item<double>());
      }
      EXPECT_TRUE(ranks[0].parameters[i].equal(ranks[1].parameters[i]));
    }
    EXPECT_LT(largest, 1e-12) << "workers " << workers;
  }
}

// The forms of model a LibTorch program holds, all accepted: the module object (held by
// reference), a shared_ptr to it, a module holder. (Anything else is a static_assert
// that names these.) Each DDP broadcasts rank 0's parameters into rank 1's module.
struct HeldNetImpl : Net {};
TORCH_MODULE(HeldNet);

TEST(TutorialPort, DdpTakesAModuleObjectASharedPtrOrAHolder) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto filled = [rank](torch::nn::Module& m) {
      torch::NoGradGuard noGrad;
      for (auto& p : m.parameters()) {
        p.fill_(rank == 0 ? 1.5 : -2.0);
      }
    };
    auto isRankZeros = [](torch::nn::Module& m) {
      for (auto& p : m.parameters()) {
        if (!p.eq(1.5).all().item<bool>()) {
          return false;
        }
      }
      return true;
    };
    Net object;  // by value, as the tutorials write it
    filled(object);
    {
      hddp::DistributedDataParallel ddp(object, *comm);
      EXPECT_EQ(&ddp.module(), &object) << "referenced, not copied";
      EXPECT_EQ(ddp.modulePtr().use_count(), 0) << "not owned";
    }
    EXPECT_TRUE(isRankZeros(object));

    auto shared = std::make_shared<Net>();
    filled(*shared);
    hddp::DistributedDataParallel fromShared(shared, *comm);
    EXPECT_TRUE(isRankZeros(*shared));
    EXPECT_EQ(fromShared.modulePtr().get(), shared.get());

    auto owned = std::make_shared<Net>();  // an object some shared_ptr owns: shared
    hddp::DistributedDataParallel fromOwnedObject(*owned, *comm);
    EXPECT_EQ(fromOwnedObject.modulePtr().get(), owned.get());
    EXPECT_GE(owned.use_count(), 2);

    HeldNet holder;
    filled(*holder);
    hddp::DistributedDataParallel fromHolder(holder, *comm);
    EXPECT_TRUE(isRankZeros(*holder));

    const std::shared_ptr<torch::nn::Module> base = std::make_shared<Net>();
    hddp::DistributedDataParallel fromBase(base, *comm);
    EXPECT_EQ(fromBase.modulePtr().get(), base.get());
  });
}

// Weights b_i / B: a rank with 2 samples counts for 2, one with 0 (its loss the NaN
// mean of nothing, or undefined) for nothing.
TEST(TutorialPort, GlobalMeanLossWeighsEachRankBySamplesAndSkipsAnEmptyRank) {
  std::vector<double> got(3, -1);
  runThreads(3, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    const int64_t local[] = {0, 2, 6};
    const double loss[] = {std::nan(""), 1.0, 3.0};
    const torch::Tensor mean = torch::tensor(loss[rank], torch::kFloat);
    got[static_cast<size_t>(rank)] =
        hddp::globalMeanLoss(*comm, rank == 0 ? torch::Tensor() : mean, local[rank]);
    // The plain average of the ranks' means would be 2.0 (or NaN).
    EXPECT_DOUBLE_EQ(hddp::globalMeanLoss(*comm, loss[rank], local[rank]), (2 * 1.0 + 6 * 3.0) / 8);
    EXPECT_THROW(hddp::globalMeanLoss(*comm, torch::ones({2}), 1), hddp::Error);  // not a mean
  });
  for (double g : got) {
    EXPECT_DOUBLE_EQ(g, (2 * 1.0 + 6 * 3.0) / 8);
  }
}

// A rank without samples checks its loss as the others do, before the collective: a
// loss of the wrong shape (reduction "none": one number per sample, none here) fails on
// every rank at once, where the rank without samples used to wait in the allreduce for
// the others until its timeout. The ranks stay in step for the next call.
TEST(TutorialPort, GlobalMeanLossChecksTheLossAlikeOnARankWithoutSamples) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions options;
    options.timeout = std::chrono::seconds(5);  // a rank left waiting fails, not hangs
    auto comm = hddp::makeCommunicator(store, rank, size, options);
    const int64_t local = rank == 0 ? 0 : 3;
    const torch::Tensor perSample = torch::ones({local});  // reduction "none"
    try {
      hddp::globalMeanLoss(*comm, perSample, local);
      ADD_FAILURE() << "rank " << rank << ": a loss of shape [" << local << "] was taken";
    } catch (const hddp::TimeoutError& e) {
      ADD_FAILURE() << "rank " << rank << " waited in the collective: " << e.what();
    } catch (const hddp::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("must be one number"),
                std::string::npos)
          << e.what_without_backtrace();
    }
    EXPECT_DOUBLE_EQ(hddp::globalMeanLoss(*comm, torch::tensor(2.0), local), 2.0);
  });
}

// Communicator::allreduce takes a const handle and a temporary view of a named tensor
// (narrow, view, detach): the result lands in the named tensor.
TEST(TutorialPort, AllreduceTakesATemporaryOrAConstHandle) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::Tensor buffer = torch::full({6}, double(rank + 1));
    comm->allreduce(buffer.narrow(0, 0, 4)).wait();  // a temporary: the view's storage
    const torch::Tensor& tail = buffer;
    comm->allreduce(tail.narrow(0, 4, 2), {hddp::ReduceOp::Max}).wait();
    EXPECT_TRUE(buffer.equal(torch::tensor({3.0, 3.0, 3.0, 3.0, 2.0, 2.0}, torch::kDouble)))
        << buffer;
    comm->allreduce(buffer.view({2, 3})).wait();
    comm->allreduce(buffer.detach()).wait();
    EXPECT_TRUE(buffer.equal(torch::tensor({12.0, 12.0, 12.0, 12.0, 8.0, 8.0}, torch::kDouble)))
        << buffer;
  });
}

// A temporary that nothing else sees would take the result with it (e.g. a .to() that
// copied: a GPU program losing what a CPU test kept). Every rank passing one throws
// ConfigError before any collective, so the ranks stay in step; .to() and .contiguous()
// that return the named tensor itself (here: same dtype, already contiguous) throw alike,
// so a test on the CPU catches what would be lost on a GPU. Named tensors, non-const or
// const, are reduced as before.
TEST(TutorialPort, AllreduceOfATemporaryThatWouldLoseTheResultThrowsOnEveryRank) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions options;
    options.timeout = std::chrono::seconds(5);  // a mismatch fails, not hangs
    auto comm = hddp::makeCommunicator(store, rank, size, options);
    torch::Tensor named = torch::full({3}, float(rank + 1));
    try {
      comm->allreduce(torch::ones({3})).wait();
      ADD_FAILURE() << "rank " << rank << ": allreduce of a fresh temporary was taken";
    } catch (const hddp::ConfigError& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("the result would be lost"),
                std::string::npos)
          << e.what_without_backtrace();
    }
    EXPECT_THROW(comm->allreduce(named.to(torch::kDouble)), hddp::ConfigError);  // a copy
    EXPECT_THROW(comm->allreduce(named.to(torch::kFloat)), hddp::ConfigError);   // named itself
    EXPECT_THROW(comm->allreduce(named.contiguous()), hddp::ConfigError);
    EXPECT_THROW(comm->allreduce(named * 2, {hddp::ReduceOp::Max}), hddp::ConfigError);
    comm->allreduce(named).wait();  // the first collective of all: none was launched above
    EXPECT_TRUE(named.equal(torch::full({3}, 3.0F))) << named;
    const torch::Tensor& constNamed = named;
    comm->allreduce(constNamed).wait();
    EXPECT_TRUE(named.equal(torch::full({3}, 6.0F))) << named;
  });
}

}  // namespace
