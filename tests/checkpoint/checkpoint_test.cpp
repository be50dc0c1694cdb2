#include "hddp/checkpoint/checkpoint.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/core/autocast.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/emulated_device.h"
#include "support/ranks.h"

namespace {

torch::nn::Sequential makeNet() {
  return torch::nn::Sequential(
      torch::nn::Linear(10, 32), torch::nn::ReLU(), torch::nn::Dropout(0.3),
      torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Dropout(0.2),
      torch::nn::Linear(32, 16), torch::nn::ReLU(), torch::nn::Linear(16, 3));
}

void copyState(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    p.value().copy_(src[p.key()]);
  }
}

TEST(Checkpoint, SequentialGradientsAreBitEqualWithDropout) {
  torch::manual_seed(0);
  auto plain = makeNet();
  auto inner = makeNet();
  copyState(*plain, *inner);
  hddp::CheckpointedSequential ckpt(inner, 3);
  auto x = torch::randn({8, 10});
  auto xp = x.clone().requires_grad_();
  auto xc = x.clone().requires_grad_();
  torch::manual_seed(42);
  plain->forward(xp).pow(2).sum().backward();
  torch::manual_seed(42);
  ckpt->forward(xc).pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(xp.grad(), xc.grad()));
  auto pp = plain->parameters();
  auto pc = inner->parameters();
  ASSERT_EQ(pp.size(), pc.size());
  for (size_t i = 0; i < pp.size(); ++i) {
    EXPECT_TRUE(torch::equal(pp[i].grad(), pc[i].grad())) << "parameter " << i;
  }
  // The RNG moved on exactly as without checkpointing.
  torch::manual_seed(42);
  plain->forward(x);
  auto a = torch::rand({4});
  torch::manual_seed(42);
  ckpt->forward(x);
  auto b = torch::rand({4});
  EXPECT_TRUE(torch::equal(a, b));
}

// The checkpointed function's gradients equal the plain function's under autocast: the
// recomputation in backward runs with the forward's autocast state (on a device, the
// autograd engine's device thread has none of its own).
void functionFormUnderAutocast(const c10::Device& device, c10::ScalarType dtype) {
  torch::manual_seed(1);
  torch::nn::Linear l1(6, 6);
  torch::nn::Linear l2(6, 2);
  l1->to(device);
  l2->to(device);
  auto x = torch::randn({4, 6}).to(device).requires_grad_();
  auto run = [&](bool useCheckpoint) {
    for (auto& p : l1->parameters()) p.mutable_grad() = torch::Tensor();
    for (auto& p : l2->parameters()) p.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    torch::Tensor y;
    {
      hddp::AutocastGuard amp(device.type(), dtype);
      auto body = [&](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{torch::gelu(l1(in[0]))};
      };
      auto h = useCheckpoint ? hddp::checkpoint(body, {x}, l1->parameters())[0] : body({x})[0];
      EXPECT_EQ(h.scalar_type(), dtype);
      y = l2(h).to(torch::kFloat).sum();
    }
    y.backward();
    return std::make_pair(x.grad().cpu().clone(), l1->weight.grad().cpu().clone());
  };
  auto plain = run(false);
  auto ckpt = run(true);
  EXPECT_TRUE(torch::equal(plain.first, ckpt.first)) << plain.first << ckpt.first;
  EXPECT_TRUE(torch::equal(plain.second, ckpt.second));
}

TEST(Checkpoint, FunctionFormUnderBf16Autocast) {
  functionFormUnderAutocast(c10::Device(c10::kCPU), c10::kBFloat16);
}

// Before, only the CPU's and CUDA's autocast state was restored for the recomputation:
// on any other accelerator it ran in float32 and the gradients differed.
TEST(Checkpoint, FunctionFormUnderFp16Autocast_Emu) {
  functionFormUnderAutocast(hddp::testing::emulatedDevice(0), c10::kHalf);
}

// After a checkpointed step the random generators are where a plain step leaves them:
// the recomputation replays the forward's draws and then puts every generator back. On
// emu, whose generator is the CPU's, the restore once rewound the CPU generator to the
// forward's state, so every later step repeated its dropout masks.
TEST(Checkpoint, TheGeneratorsMoveOnAsWithoutCheckpointing_Emu) {
  const c10::Device device = hddp::testing::emulatedDevice(0);
  torch::nn::Linear l1(8, 8);
  l1->to(device);
  torch::nn::Dropout drop(0.5);
  auto x = torch::randn({4, 8}).to(device).requires_grad_();
  auto body = [&](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{drop(l1(in[0]))};
  };
  auto after = [&](bool useCheckpoint) {
    torch::manual_seed(5);
    auto y = useCheckpoint ? hddp::checkpoint(body, {x}, l1->parameters())[0] : body({x})[0];
    y.sum().backward();
    return torch::rand({4});
  };
  EXPECT_TRUE(torch::equal(after(false), after(true)));
}

// The recomputation in backward runs under autocast; its low-precision weight casts
// must not outlive it, or the next step's checkpointed forward would use the weights
// from before the optimizer step.
TEST(Checkpoint, RecomputationUnderAutocastLeavesNoStaleWeightCasts) {
  torch::manual_seed(2);
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({4, 8});
  torch::optim::SGD opt(lin->parameters(), 0.5);
  auto body = [&](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{lin(in[0])};
  };
  torch::Tensor y;
  {
    hddp::AutocastGuard amp(c10::kCPU);
    y = hddp::checkpoint(body, {x}, lin->parameters())[0].to(torch::kFloat).pow(2).sum();
  }
  y.backward();
  opt.step();
  opt.zero_grad();
  torch::Tensor second;
  {
    hddp::AutocastGuard amp(c10::kCPU);
    second = hddp::checkpoint(body, {x}, lin->parameters())[0];
  }
  torch::Tensor fresh;
  {
    hddp::AutocastGuard amp(c10::kCPU);
    fresh = lin(x);
  }
  EXPECT_TRUE(torch::equal(second, fresh))
      << "max difference " << (second - fresh).abs().max().item<double>();
}

TEST(Checkpoint, MisuseIsReported) {
  torch::nn::Linear l(3, 3);
  auto x = torch::randn({2, 3});  // does not require grad
  auto body = [&](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{l(in[0])};
  };
  EXPECT_THROW(hddp::checkpoint(body, {x}), hddp::Error);  // nothing to differentiate
  auto xg = torch::randn({2, 3}, torch::requires_grad());
  auto out = hddp::checkpoint(body, {xg});  // l's parameters not passed
  try {
    out[0].sum().backward();
    FAIL() << "expected an error about the unlisted parameter";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("neither an input nor in `parameters`"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(hddp::CheckpointedSequential(torch::nn::Sequential(torch::nn::Linear(2, 2)), 0),
               hddp::Error);
}

TEST(Checkpoint, GradientsReachDdpBucketsAndMatchPlainDdp) {
  hddp::testing::runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(7);
    auto plainNet = torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(),
                                          torch::nn::Linear(32, 32), torch::nn::Tanh(),
                                          torch::nn::Linear(32, 3));
    auto innerNet = torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(),
                                          torch::nn::Linear(32, 32), torch::nn::Tanh(),
                                          torch::nn::Linear(32, 3));
    copyState(*plainNet, *innerNet);
    hddp::CheckpointedSequential ckpt(innerNet, 2);
    hddp::DdpOptions opts;
    opts.firstBucketBytes = 1024;
    opts.bucketCapBytes = 2048;
    hddp::DistributedDataParallel plainDdp(plainNet, *comm, opts);
    hddp::DistributedDataParallel ckptDdp(ckpt, *comm, opts);
    auto x = torch::randn({6, 10}) * (rank + 1);
    for (int step = 0; step < 2; ++step) {
      plainDdp.setBatch(rank == 0 ? 2 : 4, 6);
      ckptDdp.setBatch(rank == 0 ? 2 : 4, 6);
      plainNet->forward(x).pow(2).mean().backward();
      ckpt->forward(x).pow(2).mean().backward();
      EXPECT_GE(ckptDdp.lastStepStats().buckets, 2);
      EXPECT_EQ(ckptDdp.lastStepStats().unusedParameters, 0);
      auto pp = plainNet->parameters();
      auto pc = innerNet->parameters();
      for (size_t i = 0; i < pp.size(); ++i) {
        EXPECT_TRUE(torch::allclose(pp[i].grad(), pc[i].grad(), 1e-6, 1e-7))
            << "step " << step << " param " << i << ": " << pp[i].grad().flatten().narrow(0, 0, 3)
            << " vs " << pc[i].grad().flatten().narrow(0, 0, 3);
      }
      for (auto& p : pp) p.mutable_grad().zero_();
      for (auto& p : pc) p.mutable_grad().zero_();
    }
  });
}

// Peak allocated device memory of one training step of a deep MLP-like Sequential with
// and without checkpointing (the allocator's statistics are exact, not timing).
int64_t peakStepBytes(const c10::Device& device, int64_t batch, int64_t width, bool useCheckpoint) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 16; ++i) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::GELU());
  }
  seq->to(device);
  hddp::CheckpointedSequential ckpt(seq, 8);
  auto x = torch::randn({batch, width}).to(device);
  auto* allocator = c10::getDeviceAllocator(device.type());
  c10::impl::VirtualGuardImpl guard(device.type());
  guard.synchronizeDevice(device.index());
  allocator->resetPeakStats(device.index());
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t before =
      allocator->getDeviceStats(device.index()).allocated_bytes[aggregate].current;
  auto y = useCheckpoint ? ckpt->forward(x) : seq->forward(x);
  y.pow(2).mean().backward();
  guard.synchronizeDevice(device.index());
  return allocator->getDeviceStats(device.index()).allocated_bytes[aggregate].peak - before;
}

// The activations (32 of batch x width floats) must outweigh the weights' gradients
// (16 x width^2 floats), which checkpointing does not save.
void peakActivationMemoryDrops(const c10::Device& device, int64_t batch, int64_t width) {
  const int64_t plain = peakStepBytes(device, batch, width, false);
  const int64_t ckpt = peakStepBytes(device, batch, width, true);
  std::printf("peak step memory on %s: plain %lld MiB, checkpointed %lld MiB\n",
              device.str().c_str(), static_cast<long long>(plain >> 20),
              static_cast<long long>(ckpt >> 20));
  // 32 activations in the plain model vs ~8 segment inputs plus one segment's.
  EXPECT_LT(static_cast<double>(ckpt), 0.6 * static_cast<double>(plain));
}

TEST(Checkpoint, PeakActivationMemoryDrops_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  peakActivationMemoryDrops(c10::Device(c10::kCUDA, 0), 4096, 1024);
}

TEST(Checkpoint, PeakActivationMemoryDrops_Emu) {
  peakActivationMemoryDrops(hddp::testing::emulatedDevice(0), 2048, 256);
}

}  // namespace
