// ZeRO stages 1 and 2 with unequal shards (hddp/ddp/sharded_optimizer.h): the
// parameters after k steps equal single-device training on the whole batch (float64),
// with unequal batch shares, unequal shards, a rank without a shard and a rank without
// samples, SGD with momentum, Adam and AdamW, clipping over all shards and a GradScaler
// whose found-inf is agreed; the optimizer state re-shards from N ranks into M.
#include "hddp/ddp/sharded_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <mutex>

#include "hddp/amp/grad_scaler.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    fc2 = register_module("fc2", torch::nn::Linear(12, 12));
    fc3 = register_module("fc3", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::tanh(fc2(torch::tanh(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

std::mutex seedMutex;  // models built on several threads share the global generator

Net makeNet() {
  std::lock_guard<std::mutex> lock(seedMutex);
  torch::manual_seed(3);
  Net net;
  net->to(torch::kDouble);
  return net;
}

enum class Opt { Sgd, Adam, AdamW };

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(Opt opt, std::vector<torch::Tensor> params) {
  switch (opt) {
    case Opt::Sgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
    case Opt::Adam:
      return std::make_unique<torch::optim::Adam>(
          params, torch::optim::AdamOptions(0.01).weight_decay(1e-3));
    case Opt::AdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01));
  }
  return nullptr;
}

constexpr int64_t kGlobal = 20;

struct Batch {
  torch::Tensor x, y;
};

Batch batchOf(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return {torch::randn({kGlobal, 6}, g, torch::kDouble), torch::randint(0, 3, {kGlobal}, g)};
}

// Batch shares per step for 3 ranks: unequal, and rank 2 has none on odd steps.
std::vector<int64_t> sharesOf(int step) {
  return step % 2 == 1 ? std::vector<int64_t>{7, 13, 0} : std::vector<int64_t>{3, 9, 8};
}

struct Case {
  Opt opt = Opt::Sgd;
  int stage = 2;
  double clip = 0;      // > 0: clip the global norm
  bool scaler = false;  // GradScaler with an overflow injected at step 2
};

constexpr int kOverflowStep = 2;

// Single-device training on the whole batch.
std::vector<torch::Tensor> reference(const Case& c, int steps) {
  Net net = makeNet();
  auto opt = makeOptimizer(c.opt, net->parameters());
  for (int s = 0; s < steps; ++s) {
    if (c.scaler && s == kOverflowStep) {
      continue;  // the overflow: every rank skips the step
    }
    const Batch b = batchOf(s);
    opt->zero_grad();
    torch::cross_entropy_loss(net->forward(b.x), b.y).backward();
    if (c.clip > 0) {
      torch::nn::utils::clip_grad_norm_(net->parameters(), c.clip);
    }
    opt->step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

// One rank's training step with sharding.
void trainStep(const Case& c, int rank, int step, Net& net, hddp::DistributedDataParallel& ddp,
               hddp::ShardedOptimizer& sharded, hddp::GradScaler* scaler) {
  const auto shares = sharesOf(step);
  int64_t begin = 0;
  for (int r = 0; r < rank; ++r) {
    begin += shares[r];
  }
  const int64_t local = shares[rank];
  const Batch b = batchOf(step);
  ddp.setBatch(local, kGlobal);
  sharded.zeroGrad();
  if (local == 0) {
    ddp.finalize();
  } else {
    auto loss = torch::cross_entropy_loss(net->forward(b.x.narrow(0, begin, local)),
                                          b.y.narrow(0, begin, local));
    (scaler ? scaler->scale(loss) : loss).backward();
  }
  if (c.scaler && step == kOverflowStep && rank == sharded.layout().owner[0]) {
    // An overflow that only the owner of the first parameter sees: the other owners'
    // gradients are finite, and they must skip the step too.
    ddp.parameters()[0].grad().view(-1)[0] = std::numeric_limits<double>::infinity();
  }
  if (scaler) {
    scaler->unscale(sharded.optimizer());
  }
  if (c.clip > 0) {
    sharded.clipGradNorm(c.clip);
  }
  if (scaler) {
    if (scaler->step(sharded.optimizer())) {
      sharded.gatherParameters();
    }
    scaler->update();
  } else {
    sharded.step();
  }
}

double maxDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  }
  return d;
}

std::string caseName(const Case& c) {
  const char* names[] = {"Sgd", "Adam", "AdamW"};
  return std::string(names[static_cast<int>(c.opt)]) + "Stage" + std::to_string(c.stage) +
         (c.clip > 0 ? "Clipped" : "") + (c.scaler ? "Scaled" : "");
}

class ShardedExactness : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedExactness, EqualsSingleDeviceTrainingWithUnequalSharesAndShards) {
  const Case c = GetParam();
  const int steps = 5;
  const auto expected = reference(c, steps);
  std::vector<double> diffs(3, 1e9);
  std::vector<std::vector<int>> owners(3);
  runThreads(3, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DdpOptions ddpOptions;
    ddpOptions.firstBucketBytes = 256;  // several buckets
    ddpOptions.bucketCapBytes = 800;
    hddp::DistributedDataParallel ddp(net, *comm, ddpOptions);
    auto opt = makeOptimizer(c.opt, net->parameters());
    hddp::ShardedOptimizerOptions zero;
    zero.stage = c.stage;
    zero.weights = {1.0, 0.0, 3.0};  // rank 1 owns nothing; rank 2 three times rank 0
    hddp::ShardedOptimizer sharded(ddp, *opt, zero);
    owners[rank] = sharded.layout().owner;
    std::unique_ptr<hddp::GradScaler> scaler;
    if (c.scaler) {
      hddp::GradScalerOptions so;
      so.initScale = 1024.0;
      scaler = std::make_unique<hddp::GradScaler>(so, comm.get());
    }
    for (int s = 0; s < steps; ++s) {
      trainStep(c, rank, s, net, ddp, sharded, scaler.get());
    }
    std::vector<torch::Tensor> mine;
    for (auto& p : net->parameters()) {
      mine.push_back(p.detach());
    }
    diffs[rank] = maxDiff(mine, expected);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_LT(diffs[r], 1e-12) << "rank " << r;
  }
  // The shards are what the weights asked for: rank 1 owns nothing, ranks 0 and 2 own some.
  int owned[3] = {0, 0, 0};
  for (int o : owners[0]) {
    ++owned[o];
  }
  EXPECT_GT(owned[0], 0);
  EXPECT_EQ(owned[1], 0);
  EXPECT_GT(owned[2], owned[0]);
}

INSTANTIATE_TEST_SUITE_P(Zero, ShardedExactness,
                         ::testing::Values(Case{Opt::Sgd, 1}, Case{Opt::Sgd, 2}, Case{Opt::Adam, 1},
                                           Case{Opt::Adam, 2}, Case{Opt::AdamW, 2},
                                           Case{Opt::Adam, 2, 0.05}, Case{Opt::Sgd, 1, 0.05},
                                           Case{Opt::Adam, 2, 0, true},
                                           Case{Opt::Sgd, 2, 0.05, true}),
                         [](const auto& info) { return caseName(info.param); });

TEST(ShardedOptimizer, StageTwoKeepsOnlyItsShardsGradientsAndState) {
  std::vector<int64_t> stateBytes(2), ownGrads(2), foreignGrads(2), foreignNonZero(2);
  for (int stage : {1, 2}) {
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      Net net = makeNet();
      hddp::DdpOptions ddpOptions;
      ddpOptions.firstBucketBytes = 256;
      ddpOptions.bucketCapBytes = 800;
      hddp::DistributedDataParallel ddp(net, *comm, ddpOptions);
      torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
      hddp::ShardedOptimizerOptions zero;
      zero.stage = stage;
      zero.weights = {1.0, 3.0};
      hddp::ShardedOptimizer sharded(ddp, adam, zero);
      for (int s = 0; s < 2; ++s) {
        const Batch b = batchOf(s);
        ddp.setBatch(kGlobal / 2, kGlobal);
        sharded.zeroGrad();
        torch::cross_entropy_loss(net->forward(b.x.narrow(0, rank * 10, 10)),
                                  b.y.narrow(0, rank * 10, 10))
            .backward();
        sharded.step();
      }
      const auto& layout = sharded.layout();
      auto params = ddp.parameters();
      int64_t own = 0, foreign = 0, nonZero = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& g = params[i].grad();
        if (!g.defined()) {
          continue;
        }
        if (layout.owner[i] == rank) {
          own += g.numel();
        } else {
          foreign += g.numel();
          nonZero += g.ne(0).sum().item<int64_t>();
        }
      }
      if (stage == 2) {
        stateBytes[rank] = sharded.stateBytes();
        ownGrads[rank] = own;
        foreignGrads[rank] = foreign;
      } else {
        foreignNonZero[rank] = nonZero;
        EXPECT_GT(foreign, 0) << "stage 1 keeps the buffers of every gradient";
      }
      EXPECT_EQ(own, layout.elements[rank]);
    });
  }
  // Stage 2: no foreign gradient survives the step; stage 1: foreign ones are zeros.
  EXPECT_EQ(foreignGrads[0], 0);
  EXPECT_EQ(foreignGrads[1], 0);
  EXPECT_EQ(foreignNonZero[0], 0);
  EXPECT_EQ(foreignNonZero[1], 0);
  // Adam's state: two float64 tensors per owned element.
  EXPECT_EQ(stateBytes[0], ownGrads[0] * 2 * 8);
  EXPECT_EQ(stateBytes[1], ownGrads[1] * 2 * 8);
  EXPECT_GT(stateBytes[1], 2 * stateBytes[0]);
}

// Saved by 3 ranks with shards 1:0:3 after 3 steps, loaded by 2 ranks with equal
// shards, 2 more steps: the same parameters as 5 steps of single-device training.
TEST(ShardedOptimizer, StateSavedByThreeRanksReshardsIntoTwo) {
  const Case c{Opt::Adam, 2};
  const auto expected = reference(c, 5);
  std::vector<std::vector<uint8_t>> parts(3);
  std::vector<torch::Tensor> params;
  std::mutex paramsMutex;
  runThreads(3, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    auto opt = makeOptimizer(c.opt, net->parameters());
    hddp::ShardedOptimizerOptions zero;
    zero.weights = {1.0, 0.0, 3.0};
    hddp::ShardedOptimizer sharded(ddp, *opt, zero);
    for (int s = 0; s < 3; ++s) {
      trainStep(c, rank, s, net, ddp, sharded, nullptr);
    }
    parts[rank] = sharded.saveShard();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(paramsMutex);
      for (auto& p : net->parameters()) {
        params.push_back(p.detach().clone());
      }
    }
  });
  std::vector<double> diffs(2, 1e9);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    {
      torch::NoGradGuard g;
      auto mine = net->parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        mine[i].copy_(params[i]);
      }
    }
    hddp::DistributedDataParallel ddp(net, *comm);
    auto opt = makeOptimizer(c.opt, net->parameters());
    hddp::ShardedOptimizer sharded(ddp, *opt, {});
    sharded.loadShards(parts);
    for (int s = 3; s < 5; ++s) {
      // Two ranks: the shares of ranks 0 and 1 of the 3-rank split, rank 2's added to 1.
      const auto three = sharesOf(s);
      const std::vector<int64_t> shares{three[0], three[1] + three[2]};
      int64_t begin = rank == 0 ? 0 : shares[0];
      const Batch b = batchOf(s);
      ddp.setBatch(shares[rank], kGlobal);
      sharded.zeroGrad();
      torch::cross_entropy_loss(net->forward(b.x.narrow(0, begin, shares[rank])),
                                b.y.narrow(0, begin, shares[rank]))
          .backward();
      sharded.step();
    }
    std::vector<torch::Tensor> mine;
    for (auto& p : net->parameters()) {
      mine.push_back(p.detach());
    }
    diffs[rank] = maxDiff(mine, expected);
  });
  EXPECT_LT(diffs[0], 1e-12);
  EXPECT_LT(diffs[1], 1e-12);
}

TEST(ShardLayout, ContiguousRangesInProportionWithoutSplittingATensor) {
  const std::vector<int64_t> numels{100, 10, 10, 300, 50, 30, 500};  // 1000 elements
  auto layout = hddp::shardLayout(numels, {1.0, 1.0});
  // Midpoints 50, 105, 115, 270, 445, 485 fall below 500, 750 above.
  EXPECT_EQ(layout.begin, (std::vector<int>{0, 6}));
  EXPECT_EQ(layout.end, (std::vector<int>{6, 7}));
  EXPECT_EQ(layout.elements, (std::vector<int64_t>{500, 500}));
  layout = hddp::shardLayout(numels, {0.0, 1.0, 0.0});
  EXPECT_EQ(layout.elements, (std::vector<int64_t>{0, 1000, 0}));
  EXPECT_EQ(layout.begin[0], layout.end[0]);
  layout = hddp::shardLayout(numels, {8.0, 24.0});  // a small and a large card
  EXPECT_EQ(layout.elements[0], 120);               // 100 + 10 + 10 of a 250 target
  for (size_t i = 1; i < numels.size(); ++i) {
    EXPECT_GE(layout.owner[i], layout.owner[i - 1]);
  }
  EXPECT_THROW(hddp::shardLayout(numels, {0.0, 0.0}), hddp::ConfigError);
  EXPECT_THROW(hddp::shardLayout(numels, {1.0, -1.0}), hddp::ConfigError);
  EXPECT_THROW(hddp::shardLayout(numels, {}), hddp::ConfigError);
}

TEST(ShardLayout, ShardByParsesMemoryEqualAndRatios) {
  EXPECT_EQ(hddp::parseShardBy("memory").kind, hddp::ShardBy::Kind::Memory);
  EXPECT_EQ(hddp::parseShardBy("equal").kind, hddp::ShardBy::Kind::Equal);
  const auto by = hddp::parseShardBy("1:3.5:0");
  EXPECT_EQ(by.kind, hddp::ShardBy::Kind::Ratios);
  EXPECT_EQ(by.ratios, (std::vector<double>{1.0, 3.5, 0.0}));
  EXPECT_EQ(hddp::describeShardBy(by), "1:3.5:0");
  EXPECT_THROW(hddp::parseShardBy("1:x"), hddp::ConfigError);
  EXPECT_THROW(hddp::parseShardBy("0:0"), hddp::ConfigError);
  EXPECT_THROW(hddp::parseShardBy("1::2"), hddp::ConfigError);
  EXPECT_THROW(hddp::parseShardBy("mem"), hddp::ConfigError);
}

TEST(ShardedOptimizer, RefusesOptimizersWhoseUpdateIsNotPerElement) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    torch::optim::LBFGS lbfgs(net->parameters());
    try {
      hddp::ShardedOptimizer sharded(ddp, lbfgs, {});
      ADD_FAILURE() << "LBFGS was sharded";
    } catch (const hddp::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("per element"), std::string::npos) << e.what();
    }
    auto stranger = torch::zeros({3}, torch::kDouble).requires_grad_();
    torch::optim::SGD sgd(std::vector<torch::Tensor>{stranger}, torch::optim::SGDOptions(0.1));
    EXPECT_THROW(hddp::ShardedOptimizer(ddp, sgd, {}), hddp::ConfigError);
  });
}

}  // namespace

namespace {

// Two ranks sharing cuda:0 through Gloo's host staging: ZeRO-2 with parts 1:3 (the
// reductions to owners, the foreign buffers freed on the device, the broadcast of the
// updated parameters) equals one-device Adam on the GPU.
TEST(ShardedOptimizer, TwoRanksSharingAGpuEqualOneDeviceAdam_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const torch::Device gpu(torch::kCUDA, 0);
  const Case c{Opt::Adam, 2};
  std::vector<torch::Tensor> expected;
  {
    Net net = makeNet();
    net->to(gpu);
    auto opt = makeOptimizer(c.opt, net->parameters());
    for (int s = 0; s < 4; ++s) {
      const Batch b = batchOf(s);
      opt->zero_grad();
      torch::cross_entropy_loss(net->forward(b.x.to(gpu)), b.y.to(gpu)).backward();
      opt->step();
    }
    for (auto& p : net->parameters()) {
      expected.push_back(p.detach().cpu());
    }
  }
  std::vector<double> diffs(2, 1e9);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    net->to(gpu);
    hddp::DdpOptions ddpOptions;
    ddpOptions.bucketCapBytes = 800;
    hddp::DistributedDataParallel ddp(net, *comm, ddpOptions);
    auto opt = makeOptimizer(c.opt, net->parameters());
    hddp::ShardedOptimizerOptions zero;
    zero.weights = {1.0, 3.0};
    hddp::ShardedOptimizer sharded(ddp, *opt, zero);
    for (int s = 0; s < 4; ++s) {
      const Batch b = batchOf(s);
      ddp.setBatch(kGlobal / 2, kGlobal);
      sharded.zeroGrad();
      torch::cross_entropy_loss(net->forward(b.x.narrow(0, rank * 10, 10).to(gpu)),
                                b.y.narrow(0, rank * 10, 10).to(gpu))
          .backward();
      sharded.step();
    }
    std::vector<torch::Tensor> mine;
    for (auto& p : net->parameters()) {
      mine.push_back(p.detach().cpu());
    }
    diffs[rank] = maxDiff(mine, expected);
  });
  EXPECT_LT(diffs[0], 1e-10);
  EXPECT_LT(diffs[1], 1e-10);
}

}  // namespace

namespace {

TEST(ShardedOptimizer, RanksThatShardDifferentlyAreAConfigErrorOnEveryRank) {
  std::vector<int> refused(2, 0);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    torch::optim::Adam adam(net->parameters());
    hddp::ShardedOptimizerOptions zero;
    zero.weights = rank == 0 ? std::vector<double>{1, 3} : std::vector<double>{3, 1};
    try {
      hddp::ShardedOptimizer sharded(ddp, adam, zero);
    } catch (const hddp::ConfigError& e) {
      refused[rank] = std::string(e.what()).find("do not shard alike") != std::string::npos;
    }
  });
  EXPECT_EQ(refused, (std::vector<int>{1, 1}));
}

TEST(ShardedOptimizer, OwnersAfterABackwardOrACompressionAfterOwnersAreRefused) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    {
      auto guard = ddp.noSync();  // gradients accumulated before the owners are set
      const Batch b = batchOf(0);
      ddp.setBatch(kGlobal, kGlobal);
      torch::cross_entropy_loss(net->forward(b.x), b.y).backward();
    }
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    EXPECT_THROW(hddp::ShardedOptimizer(ddp, sgd, {}), hddp::ConfigError);
    net->zero_grad();
    hddp::ShardedOptimizer sharded(ddp, sgd, {});
    EXPECT_THROW(ddp.setCompression(hddp::GradCompression::None), hddp::ConfigError);
    EXPECT_THROW(ddp.setCompression(hddp::GradCompression::Bf16), hddp::ConfigError);
  });
}

}  // namespace
