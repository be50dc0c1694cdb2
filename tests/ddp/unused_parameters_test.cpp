// DdpOptions::findUnusedParameters with PyTorch's semantics: a parameter that no rank
// used since the last synchronized step keeps its .grad as it was (undefined stays
// undefined, so SGD skips it: no weight decay, no momentum; zeros after
// zero_grad(false) stay zeros), and one used on some ranks only gets the reduced
// gradient. Checked against single-device training on the whole batch, step by step,
// with gradients as bucket views or copies, noSync() accumulation, and ZeRO-1 and -2.
#include <c10/core/CachingDeviceAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <optional>
#include <string>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "support/emulated_device.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

struct SpareImpl : torch::nn::Module {
  SpareImpl() {
    body = register_module("body", torch::nn::Linear(6, 12));
    head = register_module("head", torch::nn::Linear(12, 3));
    spare = register_module("spare", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, bool useSpare) {
    auto h = torch::tanh(body(x));
    return useSpare ? head(h) + spare(h) : head(h);
  }
  torch::nn::Linear body{nullptr}, head{nullptr}, spare{nullptr};
};
TORCH_MODULE(Spare);

std::mutex seedMutex;  // models built on several threads share the global generator

Spare makeNet() {
  std::lock_guard<std::mutex> lock(seedMutex);
  torch::manual_seed(8);
  Spare net;
  net->to(torch::kDouble);
  return net;
}

std::unique_ptr<torch::optim::SGD> makeSgd(Spare& net) {
  return std::make_unique<torch::optim::SGD>(
      net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
}

constexpr int64_t kGlobal = 12;
// Rank 0 trains on samples [0, 5), rank 1 on [5, 12); with accumulation each rank's
// samples go in two micro-steps, split at kMicroSplit[rank].
constexpr int64_t kBegin[2] = {0, 5};
constexpr int64_t kLocal[2] = {5, 7};
constexpr int64_t kMicroSplit[2] = {2, 3};

// Which rank's forward uses the spare head, per micro-step (one micro-step without
// accumulation), and how the step clears the gradients.
struct Plan {
  bool spare[2][2];  // [micro][rank]
  bool accumulate;
  bool setToNone;
};

// Step 0 creates the spare head's momentum; later steps use it on no rank (the optimizer
// must skip it), on rank 0 only, on no rank after zero_grad(false) (zeros stay zeros and
// decay acts, as on one device), and under noSync() on rank 1 only, then on none.
const std::vector<Plan>& plans() {
  static const std::vector<Plan> p = {
      {{{true, true}, {false, false}}, false, true},
      {{{false, false}, {false, false}}, false, true},
      {{{true, false}, {false, false}}, false, true},
      {{{false, false}, {false, false}}, false, false},
      {{{false, false}, {false, false}}, false, true},
      {{{false, true}, {false, false}}, true, true},
      {{{false, false}, {false, false}}, true, true},
  };
  return p;
}

bool spareUsedAnywhere(const Plan& plan) {
  for (int m = 0; m < (plan.accumulate ? 2 : 1); ++m) {
    if (plan.spare[m][0] || plan.spare[m][1]) {
      return true;
    }
  }
  return false;
}

// Rank r's samples of micro-step m: [first, first + count).
std::pair<int64_t, int64_t> samples(const Plan& plan, int m, int rank) {
  if (!plan.accumulate) {
    return {kBegin[rank], kLocal[rank]};
  }
  return m == 0
             ? std::make_pair(kBegin[rank], kMicroSplit[rank])
             : std::make_pair(kBegin[rank] + kMicroSplit[rank], kLocal[rank] - kMicroSplit[rank]);
}

struct Data {
  torch::Tensor x, y;
};

Data dataOf(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  return {torch::randn({kGlobal, 6}, g, torch::kDouble), torch::randint(0, 3, {kGlobal}, g)};
}

enum class Mode { BucketViews, Copies, Zero1, Zero2 };

// Single-device training on the whole batch: each sample goes through the head its rank
// used; the loss is the mean over the global batch.
std::vector<std::vector<torch::Tensor>> reference(Mode mode) {
  Spare net = makeNet();
  auto sgd = makeSgd(net);
  std::vector<std::vector<torch::Tensor>> after;
  for (size_t s = 0; s < plans().size(); ++s) {
    const Plan& plan = plans()[s];
    const Data d = dataOf(static_cast<int>(s));
    sgd->zero_grad(plan.setToNone || mode == Mode::Zero1 || mode == Mode::Zero2);
    torch::Tensor loss = torch::zeros({}, torch::kDouble);
    for (int m = 0; m < (plan.accumulate ? 2 : 1); ++m) {
      for (int r = 0; r < 2; ++r) {
        const auto [first, count] = samples(plan, m, r);
        loss = loss + torch::cross_entropy_loss(
                          net->forward(d.x.narrow(0, first, count), plan.spare[m][r]),
                          d.y.narrow(0, first, count), {}, torch::Reduction::Sum);
      }
    }
    (loss / kGlobal).backward();
    sgd->step();
    std::vector<torch::Tensor> now;
    for (auto& p : net->parameters()) {
      now.push_back(p.detach().clone());
    }
    after.push_back(now);
  }
  return after;
}

std::string modeName(const ::testing::TestParamInfo<Mode>& info) {
  switch (info.param) {
    case Mode::BucketViews:
      return "BucketViews";
    case Mode::Copies:
      return "Copies";
    case Mode::Zero1:
      return "Zero1";
    case Mode::Zero2:
      return "Zero2";
  }
  return "?";
}

class UnusedParameters : public ::testing::TestWithParam<Mode> {};

TEST_P(UnusedParameters, AHeadNoRankUsedIsSkippedByTheOptimizerAsOnOneDevice) {
  const Mode mode = GetParam();
  const bool zero = mode == Mode::Zero1 || mode == Mode::Zero2;
  const auto expected = reference(mode);
  // Per rank and step: the largest difference to the reference, and whether the spare
  // head's gradient was undefined on this rank after a step that no rank used it in.
  std::vector<std::vector<double>> diffs(2);
  std::vector<std::vector<int>> undefinedGrads(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Spare net = makeNet();
    hddp::DdpOptions options;
    options.findUnusedParameters = true;
    options.gradientAsBucketView = mode != Mode::Copies;
    options.firstBucketBytes = 200;  // several buckets
    options.bucketCapBytes = 400;
    hddp::DistributedDataParallel ddp(net, *comm, options);
    auto sgd = makeSgd(net);
    std::unique_ptr<hddp::ShardedOptimizer> sharded;
    if (zero) {
      hddp::ShardedOptimizerOptions z;
      z.stage = mode == Mode::Zero1 ? 1 : 2;
      z.weights = {1.0, 2.0};
      sharded = std::make_unique<hddp::ShardedOptimizer>(ddp, *sgd, z);
    }
    // ZeRO: only the owner of the spare head keeps its gradients (the others hold none
    // at stage 2 and zeros at stage 1, which nothing steps).
    bool ownsSpare = true;
    if (sharded) {
      const auto params = ddp.parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].is_same(net->spare->weight)) {
          ownsSpare = sharded->layout().owner[i] == rank;
        }
      }
    }
    for (size_t s = 0; s < plans().size(); ++s) {
      const Plan& plan = plans()[s];
      const Data d = dataOf(static_cast<int>(s));
      if (sharded) {
        sharded->zeroGrad();
      } else {
        sgd->zero_grad(plan.setToNone);
      }
      const int micro = plan.accumulate ? 2 : 1;
      for (int m = 0; m < micro; ++m) {
        const auto [first, count] = samples(plan, m, rank);
        std::optional<hddp::DistributedDataParallel::NoSyncGuard> guard;
        if (m + 1 < micro) {
          guard.emplace(ddp);
        }
        ddp.setBatch(count, kGlobal);
        torch::cross_entropy_loss(net->forward(d.x.narrow(0, first, count), plan.spare[m][rank]),
                                  d.y.narrow(0, first, count))
            .backward();
      }
      if (!spareUsedAnywhere(plan) && plan.setToNone && ownsSpare) {
        undefinedGrads[rank].push_back(!net->spare->weight.grad().defined() &&
                                       !net->spare->bias.grad().defined());
      }
      if (sharded) {
        sharded->step();
      } else {
        sgd->step();
      }
      double diff = 0;
      auto mine = net->parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        diff = std::max(diff, (mine[i] - expected[s][i]).abs().max().item<double>());
      }
      diffs[rank].push_back(diff);
    }
  });
  for (int r = 0; r < 2; ++r) {
    for (size_t s = 0; s < plans().size(); ++s) {
      EXPECT_LT(diffs[r][s], 1e-12) << "rank " << r << ", step " << s;
    }
    for (size_t k = 0; k < undefinedGrads[r].size(); ++k) {
      EXPECT_TRUE(undefinedGrads[r][k]) << "rank " << r << ", unused step #" << k;
    }
  }
  EXPECT_GE(undefinedGrads[0].size() + undefinedGrads[1].size(), 3u)
      << "the steps that no rank used the spare head in were checked";
}

INSTANTIATE_TEST_SUITE_P(Ddp, UnusedParameters,
                         ::testing::Values(Mode::BucketViews, Mode::Copies, Mode::Zero1,
                                           Mode::Zero2),
                         modeName);

// A rank that ran out of memory abandons its step: it must not then copy the gradients
// of the parameters it did not use (kept so that a parameter no rank used keeps its
// .grad), which the abandoned step never applies. Before the fix abandonStep() cloned
// the spare head's zeros (after zero_grad(false)) on the device that had just run out
// of memory: 4 MB here, counted by emu's allocator.
TEST(Ddp, AnAbandonedStepCopiesNoGradientOfAnUnusedParameter_Emu) {
  struct BigSpareImpl : torch::nn::Module {
    BigSpareImpl() {
      head = register_module("head", torch::nn::Linear(8, 3));
      spare = register_module("spare", torch::nn::Linear(1000, 1000));
    }
    torch::nn::Linear head{nullptr}, spare{nullptr};
  };
  hddp::testing::emulatedDevice(0);  // installs emu
  std::vector<int64_t> copied(2, -1);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    const c10::Device device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(rank));
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto net = std::make_shared<BigSpareImpl>();
    net->to(device);
    hddp::DdpOptions options;
    options.findUnusedParameters = true;
    hddp::DistributedDataParallel ddp(net, *comm, options);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    const at::Tensor x = torch::randn({4, 8}).to(device);
    for (int step = 0; step < 2; ++step) {
      sgd.zero_grad(/*set_to_none=*/false);
      for (const auto& p : net->parameters()) {
        if (!p.grad().defined()) {
          p.mutable_grad() = torch::zeros_like(p);  // zeros, as zero_grad(false) leaves them
        }
      }
      ddp.setBatch(4, 8);
      if (step == 1 && rank == 1) {
        // Out of memory before the backward: abandon, and count what that allocates.
        auto* allocator = c10::getDeviceAllocator(device.type());
        allocator->resetAccumulatedStats(device.index());
        ASSERT_TRUE(ddp.abandonStep());
        const auto stats = allocator->getDeviceStats(device.index());
        copied[1] = stats.allocated_bytes[0].allocated;
      } else {
        torch::cross_entropy_loss(net->head(x), torch::zeros({4}, torch::kLong).to(device))
            .backward();
      }
      const bool abandoned = ddp.lastStepAbandoned();
      EXPECT_EQ(abandoned, step == 1) << "rank " << rank << ", step " << step;
      if (!abandoned) {
        sgd.step();
      }
    }
  });
  const int64_t spareBytes = 1000 * 1000 * 4;
  EXPECT_GE(copied[1], 0);
  EXPECT_LT(copied[1], spareBytes) << "abandonStep() allocated " << copied[1]
                                   << " bytes: the unused parameters' gradients were copied";
  hddp::emu::checkNoViolations();
}

}  // namespace
