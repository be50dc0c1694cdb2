// PowerSGD (hddp/ddp/power_sgd.h): exact weighted results where the rank covers a
// matrix; its state in and out; a non-finite step kept out of its memories. (Against
// PyTorch's own hook: power_sgd_vs_pytorch_test.cpp.)
#include "hddp/ddp/power_sgd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/balance/compression_model.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/emulated_device.h"
#include "support/power_sgd_steps.h"
#include "support/ranks.h"

namespace {

using hddp::testing::makeBucket;
using hddp::testing::runStep;
using hddp::testing::runThreads;

struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 6));
    fc2 = register_module("fc2", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(SmallNet);

void copyParameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard guard;
  auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    p.value().copy_(source[p.key()]);
  }
}

// With a rank at least every matrix's smaller side, PowerSGD is exact, and so is the
// weighted result: through DDP on 3 ranks with unequal shares that change every step
// (a rank with no samples among them), k steps of SGD with momentum give the parameters
// of single-device training on the whole batch (float64). The error-feedback memories
// then sum to zero at every step; kept in other units, they would not, and the steps
// after the first compressed one would drift.
// `devices`: each rank's. Ranks that are threads of one process need devices of their
// own: autograd runs a device's backward on one thread per device, which ranks sharing
// the device would share, and DDP's end of backward on one rank would hold up the others'.
void expectExactWithACoveringRank(const std::vector<c10::Device>& devices) {
  const int world = 3;
  const int64_t B = 12;
  const int steps = 6;
  const std::vector<std::vector<int64_t>> splits = {{4, 4, 4}, {5, 0, 7}, {1, 9, 2},
                                                    {0, 6, 6}, {8, 3, 1}, {12, 0, 0}};
  torch::manual_seed(5);
  SmallNet reference;
  reference->to(torch::kDouble);
  SmallNet initial;
  initial->to(torch::kDouble);
  copyParameters(*reference, *initial);
  std::vector<torch::Tensor> xs;
  std::vector<torch::Tensor> ys;
  for (int s = 0; s < steps; ++s) {
    xs.push_back(torch::randn({B, 10}, torch::kDouble));
    ys.push_back(torch::randint(0, 4, {B}, torch::kLong));
  }
  {
    torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::cross_entropy_loss(reference->forward(xs[s]), ys[s]).backward();
      opt.step();
    }
  }
  std::vector<double> diffs(world, 1e9);
  std::vector<int64_t> compressedSteps(world, 0);
  runThreads(world, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    const c10::Device device = devices[static_cast<size_t>(rank)];
    SmallNet model;
    model->to(torch::kDouble);
    copyParameters(*initial, *model);
    model->to(device);
    hddp::PowerSgdOptions o;
    o.rank = 6;                  // fc1's weight is 6 x 10, fc2's 4 x 6
    o.minCompressionRate = 0.1;  // compress them all the same
    o.startStep = 2;
    auto state = std::make_shared<hddp::PowerSgdState>(o);
    hddp::DdpOptions opts;
    opts.commHook = hddp::powerSgdHook(state);
    hddp::DistributedDataParallel ddp(model, *comm, opts);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      int64_t start = 0;
      for (int r = 0; r < rank; ++r) {
        start += splits[s][r];
      }
      const int64_t b = splits[s][rank];
      ddp.setBatch(b, B);
      opt.zero_grad();
      if (b > 0) {
        torch::cross_entropy_loss(model->forward(xs[s].narrow(0, start, b).to(device)),
                                  ys[s].narrow(0, start, b).to(device))
            .backward();
      } else {
        ddp.finalize();
      }
      opt.step();
    }
    compressedSteps[rank] = state->step() - o.startStep;
    EXPECT_LT(state->elementsAfter(), state->elementsBefore() * 2);
    double worst = 0;
    auto expected = reference->named_parameters();
    for (auto& p : model->named_parameters()) {
      EXPECT_EQ(p.value().device(), device);
      worst = std::max(worst, (p.value().cpu() - expected[p.key()]).abs().max().item<double>());
    }
    diffs[rank] = worst;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(compressedSteps[r], steps - 2) << "rank " << r;
    // float64; the orthogonalisation of a nearly singular P costs some digits.
    EXPECT_LT(diffs[r], 1e-7) << "rank " << r;
  }
}

}  // namespace

TEST(PowerSgd, WithARankCoveringEveryMatrixTheWeightedResultIsExact) {
  const c10::Device cpu(c10::kCPU);
  expectExactWithACoveringRank({cpu, cpu, cpu});
}

// The same with a rank on a GPU (the hook's tensors on it, Gloo staging them through the
// host) beside two CPU ranks.
TEST(PowerSgd, WithARankCoveringEveryMatrixTheWeightedResultIsExact_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  const c10::Device cpu(c10::kCPU);
  expectExactWithACoveringRank({c10::Device(c10::kCUDA, 0), cpu, cpu});
}

// Low rank on real gradients is an approximation: after a few compressed steps the
// reduced gradient is close to, not equal to, the exact one, and error feedback makes
// the sum over steps closer still (what was left out is sent later). bfloat16 on the
// wire stays close to float32 on the wire.
TEST(PowerSgd, LowRankApproximatesAndErrorFeedbackCatchesUp) {
  const std::vector<std::vector<int64_t>> shapes = {{32, 24}, {24}};
  for (auto wire : {at::kFloat, at::kBFloat16}) {
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      hddp::PowerSgdOptions o;
      o.rank = 2;
      o.startStep = 2;
      o.wireType = wire;
      const hddp::CommHook hook = hddp::powerSgdHook(o);
      at::Tensor exactSum = at::zeros({32 * 24 + 24});
      at::Tensor sentSum = at::zeros({32 * 24 + 24});
      double firstRelative = 0;
      for (int step = 0; step < 12; ++step) {
        auto g = at::Generator(at::make_generator<at::CPUGeneratorImpl>(100 * step + 7));
        // The same low-rank-ish gradient on both ranks, scaled per rank: the exact sum
        // is known without a collective.
        at::Tensor common = at::randn({32 * 24 + 24}, g);
        at::Tensor mine = common * (rank == 0 ? 0.25 : 0.75);
        std::vector<hddp::GradBucket> buckets{makeBucket(0, true, shapes, mine)};
        runStep(hook, *comm, buckets);
        if (step < 2) {
          EXPECT_TRUE(at::allclose(buckets[0].buffer, common, 1e-6, 1e-6)) << "a plain step";
          continue;
        }
        exactSum += common;
        sentSum += buckets[0].buffer;
        const double relative =
            ((buckets[0].buffer - common).norm() / common.norm()).item<double>();
        if (step == 2) {
          firstRelative = relative;
          EXPECT_GT(relative, 0.05) << "a rank-2 view of a random 32 x 24 matrix is not exact";
        }
        // The whole bias travels uncompressed.
        EXPECT_TRUE(at::allclose(buckets[0].buffer.narrow(0, 32 * 24, 24),
                                 common.narrow(0, 32 * 24, 24), 1e-2, 1e-2));
      }
      const double accumulated = ((sentSum - exactSum).norm() / exactSum.norm()).item<double>();
      EXPECT_LT(accumulated, firstRelative)
          << "with error feedback the sum over steps is closer than one step";
    });
  }
}

// P and Q travel in the gradients' type unless wireType names another: with a rank that
// covers the matrix, float64 gradients come back as their exact sum to float64 rounding;
// cast to float32 on the wire (as the default was) they are off by float32's rounding.
TEST(PowerSgd, FactorsTravelInTheGradientsTypeByDefault) {
  const std::vector<std::vector<int64_t>> shapes = {{6, 4}};
  for (auto wire : {c10::ScalarType::Undefined, at::kFloat}) {
    std::vector<double> worst(2, 0.0);
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      hddp::PowerSgdOptions o;
      o.rank = 4;
      o.minCompressionRate = 0.1;  // compressed although the rank covers it
      o.startStep = 2;
      o.wireType = wire;
      const hddp::CommHook hook = hddp::powerSgdHook(o);
      for (int step = 0; step < 4; ++step) {
        auto g = at::Generator(at::make_generator<at::CPUGeneratorImpl>(31 * step + 1));
        const at::Tensor common = at::randn({24}, g, at::kDouble);
        const at::Tensor mine = common * (rank == 0 ? 0.25 : 0.75);
        std::vector<hddp::GradBucket> buckets{makeBucket(0, true, shapes, mine)};
        runStep(hook, *comm, buckets);
        if (step >= o.startStep) {
          EXPECT_EQ(buckets[0].buffer.scalar_type(), at::kDouble);
          worst[static_cast<size_t>(rank)] = std::max(
              worst[static_cast<size_t>(rank)],
              ((buckets[0].buffer - common).abs().max() / common.abs().max()).item<double>());
        }
      }
    });
    for (double w : worst) {
      if (wire == c10::ScalarType::Undefined) {
        EXPECT_LT(w, 1e-12) << "float64 factors on the wire";
      } else {
        EXPECT_GT(w, 1e-10) << "float32 on the wire rounds (else this test tells nothing)";
        EXPECT_LT(w, 1e-5);
      }
    }
  }
}

// The compression model that --compress auto and what-if price PowerSGD with
// (hddp/balance/compression_model.h) counts the elements the hook sends: matrices worth
// compressing as P and Q, the others (a small matrix, biases) whole.
TEST(PowerSgd, TheCompressionModelCountsWhatTheHookSends) {
  const std::vector<std::vector<int64_t>> shapes = {{48, 40}, {48}, {6, 40}, {6}, {3, 4, 5}};
  for (int rank : {1, 3}) {
    std::shared_ptr<hddp::PowerSgdState> state;
    runThreads(2, [&](int r, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, r, size);
      hddp::PowerSgdOptions o;
      o.rank = rank;
      o.startStep = 2;
      auto mine = std::make_shared<hddp::PowerSgdState>(o);
      const hddp::CommHook hook = hddp::powerSgdHook(mine);
      int64_t numel = 0;
      for (const auto& shape : shapes) {
        numel += c10::multiply_integers(shape);
      }
      for (int step = 0; step < 5; ++step) {
        std::vector<hddp::GradBucket> buckets{makeBucket(0, true, shapes, at::randn({numel}))};
        runStep(hook, *comm, buckets);
      }
      if (r == 0) {
        state = mine;
      }
    });
    hddp::GradientLayout layout;
    layout.shapes = shapes;
    hddp::CompressionSpec spec;
    spec.kind = hddp::CompressionSpec::Kind::PowerSgd;
    spec.rank = rank;
    const auto traffic = hddp::compressionTraffic(spec, layout);
    ASSERT_TRUE(state);
    EXPECT_EQ(state->elementsBefore(), 3 * (layout.bytes() / 4)) << "three compressed steps";
    EXPECT_DOUBLE_EQ(static_cast<double>(state->elementsAfter()), 3 * traffic.wireBytes / 4)
        << "rank " << rank;
  }
}

// The state goes out and comes back: a hook whose state was saved after some steps and
// loaded into a fresh state continues exactly as the uninterrupted one. A memory whose
// size no longer fits its bucket is dropped (drawn afresh), not misapplied. Keys it does
// not know are refused.
TEST(PowerSgd, StateRoundTripsAndAMisfitIsDropped) {
  const std::vector<std::vector<int64_t>> shapes = {{16, 12}, {12}};
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::PowerSgdOptions o;
    o.rank = 2;
    o.startStep = 2;
    auto a = std::make_shared<hddp::PowerSgdState>(o);
    auto b = std::make_shared<hddp::PowerSgdState>(o);
    auto hookA = hddp::powerSgdHook(a);
    auto hookB = hddp::powerSgdHook(b);
    auto input = [&](int step) {
      auto g = at::Generator(at::make_generator<at::CPUGeneratorImpl>(10 * step + rank));
      return at::randn({16 * 12 + 12}, g);
    };
    for (int step = 0; step < 8; ++step) {
      if (step == 5) {
        b->loadStateDict(a->stateDict());
      }
      std::vector<hddp::GradBucket> bucketsA{makeBucket(0, true, shapes, input(step))};
      runStep(hookA, *comm, bucketsA);
      if (step >= 5) {
        std::vector<hddp::GradBucket> bucketsB{makeBucket(0, true, shapes, input(step))};
        runStep(hookB, *comm, bucketsB);
        EXPECT_TRUE(at::equal(bucketsA[0].buffer, bucketsB[0].buffer)) << "step " << step;
      }
    }
    EXPECT_EQ(b->step(), a->step());
    // Another model's buckets: the memories do not fit and are dropped, not applied.
    const std::vector<std::vector<int64_t>> other = {{8, 12}, {12}};
    std::vector<hddp::GradBucket> small{makeBucket(0, true, other, at::ones({8 * 12 + 12}))};
    runStep(hookA, *comm, small);
    EXPECT_TRUE(at::isfinite(small[0].buffer).all().item<bool>());
    EXPECT_THROW(a->loadStateDict({{"p.0", at::zeros({3})}}), hddp::Error);
    EXPECT_THROW(a->loadStateDict({{"error.x", at::zeros({3})}}), hddp::Error);
    EXPECT_THROW(a->loadStateDict({{"draws", at::tensor(int64_t{1} << 40)}}), hddp::Error);
    EXPECT_THROW(a->loadStateDict({{"step", at::tensor(int64_t{-1})}}), hddp::Error);
    // An earlier hddp's per-bucket memories are dropped (logged), not misapplied.
    a->loadStateDict(
        {{"step", at::tensor(int64_t{9})}, {"error.0", at::ones({204})}, {"q.0", at::ones({24})}});
    for (const auto& item : a->stateDict()) {
      EXPECT_TRUE(item.first == "step" || item.first == "draws") << item.first;
    }
    EXPECT_EQ(a->step(), 9);
  });
}

// A step whose gradient overflowed (inf on one rank, as float16 autocast gives before
// the GradScaler skips the step) leaves the error memory as it was: the next finite step
// is finite again. Options out of range are refused with ConfigError.
TEST(PowerSgd, ANonFiniteStepStaysOutOfTheMemories) {
  const std::vector<std::vector<int64_t>> shapes = {{16, 12}};
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::PowerSgdOptions o;
    o.startStep = 2;
    auto state = std::make_shared<hddp::PowerSgdState>(o);
    auto hook = hddp::powerSgdHook(state);
    for (int step = 0; step < 6; ++step) {
      at::Tensor g = at::randn({16 * 12});
      if (step == 3 && rank == 1) {
        g[5] = std::numeric_limits<float>::infinity();
      }
      std::vector<hddp::GradBucket> buckets{makeBucket(0, true, shapes, g)};
      runStep(hook, *comm, buckets);
      const bool finite = at::isfinite(buckets[0].buffer).all().item<bool>();
      EXPECT_EQ(finite, step != 3) << "step " << step;
    }
    for (const auto& item : state->stateDict()) {
      if (item.first.rfind("error/", 0) == 0 || item.first.rfind("q/", 0) == 0) {
        EXPECT_TRUE(at::isfinite(item.second).all().item<bool>()) << item.first;
      }
    }
  });
  // An all-zero gradient (an unused layer): P and Q are zero columns, which stay zero
  // (PyTorch's Gram-Schmidt divides 0 by 0).
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::PowerSgdOptions o;
    o.startStep = 2;
    auto hook = hddp::powerSgdHook(o);
    for (int step = 0; step < 4; ++step) {
      std::vector<hddp::GradBucket> buckets{makeBucket(0, true, shapes, at::zeros({16 * 12}))};
      runStep(hook, *comm, buckets);
      EXPECT_TRUE(at::equal(buckets[0].buffer, at::zeros({16 * 12}))) << "step " << step;
    }
    // Used again: the gradient gets through (a zero Q kept as the warm start would not).
    std::vector<hddp::GradBucket> used{makeBucket(0, true, shapes, at::ones({16 * 12}))};
    runStep(hook, *comm, used);
    EXPECT_GT(used[0].buffer.abs().sum().item<double>(), 1.0) << "the layer is used again";
  });
  auto refused = [](hddp::PowerSgdOptions o) {
    EXPECT_THROW(hddp::PowerSgdState{o}, hddp::ConfigError);
  };
  hddp::PowerSgdOptions o;
  o.rank = 0;
  refused(o);
  o = {};
  o.startStep = 1;
  refused(o);
  o = {};
  o.wireType = at::kInt;
  refused(o);
  for (auto wire : {c10::ScalarType::Undefined, at::kDouble, at::kFloat}) {
    o = {};
    o.wireType = wire;
    EXPECT_NO_THROW(hddp::PowerSgdState{o});
  }
  o = {};
  o.startStep = 1;
  o.errorFeedback = false;
  o.warmStart = false;
  EXPECT_NO_THROW(hddp::PowerSgdState{o});
}

// The same on the emulated accelerator (the hook's tensors on emu:0 and emu:1, Gloo
// staging them through the host, beside a CPU rank): QR in float64 for the rank-6
// factors on devices that are not the CPU.
TEST(PowerSgd, WithARankCoveringEveryMatrixTheWeightedResultIsExact_Emu) {
  expectExactWithACoveringRank(
      {hddp::testing::emulatedDevice(0), hddp::testing::emulatedDevice(1), c10::Device(c10::kCPU)});
}

// --compress auto times PowerSGD's arithmetic on the rank's own device (synchronised
// around each pass, so the time is the device's, not the launches').
TEST(PowerSgd, ComputeIsTimedOnTheDevice_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  hddp::PowerSgdOptions o;
  o.rank = 4;
  const std::vector<std::vector<int64_t>> shapes = {{512, 512, 3, 3}, {512}, {1000, 512}};
  const double seconds = hddp::timePowerSgdCompute(shapes, o, c10::Device(c10::kCUDA, 0));
  std::printf("PowerSGD rank 4 compute on cuda:0: %.3f ms\n", seconds * 1e3);
  EXPECT_GT(seconds, 0.0);
  EXPECT_LT(seconds, 1.0);
}
