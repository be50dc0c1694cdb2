// SyncBatchNorm: a BatchNorm model trained with unequal local batches matches
// single-device training on the global batch; plain per-rank BatchNorm does not.
#include "hddp/ddp/sync_batch_norm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

// The largest difference of `model`'s parameters and floating-point buffers to
// `reference`'s of the same names.
double maxDifference(const torch::nn::Module& model, const torch::nn::Module& reference) {
  double d = 0;
  auto ref = reference.named_parameters();
  for (const auto& p : model.named_parameters()) {
    d = std::max(d, (p.value() - ref[p.key()]).abs().max().item<double>());
  }
  auto refBuffers = reference.named_buffers();
  for (const auto& b : model.named_buffers()) {
    if (b.value().is_floating_point()) {
      d = std::max(d, (b.value() - refBuffers[b.key()]).abs().max().item<double>());
    }
  }
  return d;
}

// conv -> norm -> relu -> pool -> linear; the norm is SyncBatchNorm or BatchNorm2d.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool sync) : sync(sync) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)));
    if (sync) {
      sbn = register_module("bn", hddp::SyncBatchNorm(4));
    } else {
      bn = register_module("bn", torch::nn::BatchNorm2d(4));
    }
    fc = register_module("fc", torch::nn::Linear(4, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = conv(x);
    h = sync ? sbn(h) : bn(h);
    return fc(torch::adaptive_avg_pool2d(torch::relu(h), {1, 1}).flatten(1));
  }
  bool sync;
  torch::nn::Conv2d conv{nullptr};
  hddp::SyncBatchNorm sbn{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// Trains on `world` ranks with the split {2, 5, 1, ...} (rank r of the first three) for
// 3 steps and returns, per rank, the max difference of parameters and buffers to
// single-device training on the concatenated batch.
std::vector<double> trainAndCompare(int world, bool sync) {
  const std::vector<int64_t> split =
      world == 2 ? std::vector<int64_t>{2, 6} : std::vector<int64_t>{2, 5, 1};
  const int64_t B = 8;
  torch::manual_seed(5);
  Net reference(sync);
  Net initial(sync);
  {
    torch::NoGradGuard g;
    auto src = reference->named_parameters();
    for (auto& p : initial->named_parameters()) {
      p.value().copy_(src[p.key()]);
    }
  }
  std::vector<torch::Tensor> xs;
  std::vector<torch::Tensor> ys;
  for (int s = 0; s < 3; ++s) {
    xs.push_back(torch::randn({B, 3, 5, 5}) * 2 + 1);
    ys.push_back(torch::randint(0, 3, {B}, torch::kLong));
  }
  torch::optim::SGD refOpt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < 3; ++s) {
    refOpt.zero_grad();
    torch::cross_entropy_loss(reference->forward(xs[s]), ys[s]).backward();
    refOpt.step();
  }
  std::vector<double> diffs(world, 1e9);
  runThreads(world, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net model(sync);
    {
      torch::NoGradGuard g;
      auto src = initial->named_parameters();
      for (auto& p : model->named_parameters()) {
        p.value().copy_(src[p.key()]);
      }
    }
    if (sync) {
      hddp::convertSyncBatchNorm(*model, *comm);  // attaches the communicator
    }
    hddp::DistributedDataParallel ddp(model, *comm);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    int64_t start = 0;
    for (int r = 0; r < rank; ++r) {
      start += split[r];
    }
    for (int s = 0; s < 3; ++s) {
      ddp.setBatch(split[rank], B);
      opt.zero_grad();
      torch::cross_entropy_loss(model->forward(xs[s].narrow(0, start, split[rank])),
                                ys[s].narrow(0, start, split[rank]))
          .backward();
      opt.step();
    }
    diffs[rank] = maxDifference(*model, *reference);
  });
  return diffs;
}

TEST(SyncBatchNorm, UnequalSplitMatchesSingleDeviceTrainingWithStatistics) {
  for (int world : {2, 3}) {
    auto diffs = trainAndCompare(world, /*sync=*/true);
    for (int r = 0; r < world; ++r) {
      EXPECT_LT(diffs[r], 1e-5) << "world " << world << " rank " << r;
    }
  }
}

TEST(SyncBatchNorm, PlainPerRankBatchNormDoesNotMatch) {
  auto diffs = trainAndCompare(3, /*sync=*/false);
  EXPECT_GT(diffs[0], 1e-3) << "per-rank BatchNorm unexpectedly matched the global batch";
}

TEST(SyncBatchNorm, SingleProcessIsPlainBatchNorm) {
  torch::manual_seed(1);
  hddp::SyncBatchNorm sync(6);
  torch::nn::BatchNorm2d plain(6);
  auto x = torch::randn({4, 6, 3, 3}, torch::requires_grad());
  auto x2 = x.detach().clone().requires_grad_();
  auto y1 = sync(x);
  auto y2 = plain(x2);
  EXPECT_TRUE(torch::allclose(y1, y2, 1e-5, 1e-6));
  auto r = torch::randn_like(y1);  // sum(y*y) would be constant: use a projection
  (y1 * r).sum().backward();
  (y2 * r).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x2.grad(), 1e-4, 1e-6));
  EXPECT_TRUE(torch::allclose(sync->weight.grad(), plain->weight.grad(), 1e-4, 1e-6));
  EXPECT_TRUE(torch::allclose(sync->running_var, plain->running_var, 1e-5, 1e-6));
  sync->eval();
  plain->eval();
  EXPECT_TRUE(torch::allclose(sync(x), plain(x2), 1e-5, 1e-6));
}

// In eval mode without running statistics each rank normalises its own batch and runs no
// collective (as PyTorch's SyncBatchNorm): a sharded evaluation gives the ranks different
// numbers of batches, and a collective there would pair with something else or hang.
TEST(SyncBatchNorm, EvalWithoutRunningStatisticsRunsNoCollective) {
  std::vector<at::Tensor> outputs(2);
  std::vector<at::Tensor> inputs(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(10);  // a collective left unpaired fails, not hangs
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    hddp::SyncBatchNormOptions o(3);
    o.trackRunningStats = false;
    hddp::SyncBatchNorm bn(o, comm.get());
    bn->eval();
    torch::manual_seed(5 + rank);
    // Rank 0 evaluates two batches, rank 1 one.
    for (int batch = 0; batch < (rank == 0 ? 2 : 1); ++batch) {
      inputs[rank] = torch::randn({4, 3, 2, 2});
      outputs[rank] = bn(inputs[rank]);
    }
    comm->barrier().wait();  // the ranks still pair their collectives afterwards
  });
  for (int r = 0; r < 2; ++r) {
    torch::nn::BatchNorm2d plain(torch::nn::BatchNorm2dOptions(3).track_running_stats(false));
    plain->eval();
    EXPECT_TRUE(torch::allclose(outputs[r], plain(inputs[r]), 1e-5, 1e-6)) << "rank " << r;
  }
}

// A module that reaches its layers only through the registry, so conversion can work.
struct ByNameImpl : torch::nn::Module {
  ByNameImpl() { register_module("bn", torch::nn::BatchNorm2d(3)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto child = named_children()["bn"];
    if (auto* s = child->as<hddp::SyncBatchNormImpl>()) {
      return s->forward(x);
    }
    return child->as<torch::nn::BatchNorm2dImpl>()->forward(x);
  }
};
TORCH_MODULE(ByName);

TEST(SyncBatchNorm, ConverterSwapsRegistryAndSequentialLayersAndRefusesFieldHeldOnes) {
  runThreads(1, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    ByName byName;
    {
      torch::NoGradGuard g;
      byName->named_buffers()["bn.running_mean"].fill_(0.5);
    }
    auto converted = hddp::convertSyncBatchNorm(*byName, *comm);
    ASSERT_EQ(converted, std::vector<std::string>{"bn"});
    auto* sync = byName->named_children()["bn"]->as<hddp::SyncBatchNormImpl>();
    ASSERT_NE(sync, nullptr);
    EXPECT_TRUE(sync->running_mean.equal(torch::full({3}, 0.5f)));
    torch::nn::Sequential seq(torch::nn::Conv2d(3, 3, 1), torch::nn::BatchNorm2d(3));
    EXPECT_EQ(hddp::convertSyncBatchNorm(*seq, *comm), std::vector<std::string>{"1"});
    EXPECT_NE(seq[1]->as<hddp::SyncBatchNormImpl>(), nullptr);
    Net held(/*sync=*/false);  // its forward calls its member field `bn`
    try {
      hddp::convertSyncBatchNorm(*held, *comm);
      FAIL() << "expected a ConfigError";
    } catch (const hddp::ConfigError& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("'bn'"), std::string::npos)
          << e.what();
    }
    EXPECT_NE(held->named_children()["bn"]->as<torch::nn::BatchNorm2dImpl>(), nullptr);
  });
}

// linear -> SyncBatchNorm(4) -> relu -> a bias-free head (2x4) that only some samples go
// through; the others take the first two channels. Double precision.
struct HeadNetImpl : torch::nn::Module {
  HeadNetImpl() {
    lin = register_module("lin", torch::nn::Linear(3, 4));
    bn = register_module("bn", hddp::SyncBatchNorm(4));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(4, 2).bias(false)));
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x, bool useHead) {
    auto h = torch::relu(bn(lin(x)));
    return useHead ? head(h) : h.narrow(1, 0, 2);
  }
  torch::nn::Linear lin{nullptr};
  hddp::SyncBatchNorm bn{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(HeadNet);

// findUnusedParameters, rank 0 uses the head and rank 1 does not; the head has a bucket of
// its own (64 bytes). Rank 0's head is ready before SyncBatchNorm's backward sum, rank 1's
// only when backward ends: sent during backward, rank 0's head bucket (8 doubles) met
// rank 1's SyncBatchNorm sum (2 x 4 channels, 8 doubles) and each was summed with the
// other, silently. (Found by the differential matrix, tools/diff-matrix, seed 1060.)
TEST(SyncBatchNorm, AParameterUsedOnSomeRanksDoesNotCrossItsBackwardSums) {
  const int64_t B = 8;
  torch::manual_seed(11);
  HeadNet initial;
  std::vector<torch::Tensor> xs;
  std::vector<torch::Tensor> ys;
  for (int s = 0; s < 2; ++s) {
    xs.push_back(torch::randn({B, 3}, torch::kDouble));
    ys.push_back(torch::randn({B, 2}, torch::kDouble));
  }
  auto copyFrom = [&](HeadNet& to) {
    torch::NoGradGuard g;
    auto src = initial->named_parameters();
    for (auto& p : to->named_parameters()) {
      p.value().copy_(src[p.key()]);
    }
  };
  // One device, the whole batch: samples 0-3 (rank 0's) take the head, 4-7 do not.
  HeadNet reference;
  copyFrom(reference);
  torch::optim::SGD refOpt(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 2; ++s) {
    refOpt.zero_grad();
    auto h = torch::relu(reference->bn(reference->lin(xs[s])));
    auto loss = 0.5 * torch::mse_loss(reference->head(h.narrow(0, 0, 4)), ys[s].narrow(0, 0, 4)) +
                0.5 * torch::mse_loss(h.narrow(0, 4, 4).narrow(1, 0, 2), ys[s].narrow(0, 4, 4));
    loss.backward();
    refOpt.step();
  }
  std::vector<double> diffs(2, 1e9);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(20);  // crossed sums of unlike sizes would hang
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    HeadNet model;
    copyFrom(model);
    model->bn->setCommunicator(comm.get());
    hddp::DdpOptions options;
    options.findUnusedParameters = true;
    options.firstBucketBytes = 64;  // the head alone
    options.bucketCapBytes = 1 << 20;
    options.rebuildBuckets = false;
    hddp::DistributedDataParallel ddp(model, *comm, options);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      ddp.setBatch(4, B);
      opt.zero_grad();
      torch::mse_loss(model->forward(xs[s].narrow(0, 4 * rank, 4), rank == 0),
                      ys[s].narrow(0, 4 * rank, 4))
          .backward();
      opt.step();
    }
    diffs[rank] = maxDifference(*model, *reference);
  });
  EXPECT_LT(diffs[0], 1e-12);
  EXPECT_LT(diffs[1], 1e-12);
}

}  // namespace
