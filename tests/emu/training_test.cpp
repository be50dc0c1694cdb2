// hddp::emu: autograd and an optimiser on emu give the CPU's result.

#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <limits>
#include <thread>

#include "emu_fixture.h"
#include "hddp/ddp/power_sgd.h"

namespace hddp {
namespace emu {
namespace testing {
namespace {

using EmuTraining = EmuTest;

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// SGD with momentum and weight decay.
std::unique_ptr<torch::optim::Optimizer> sgd(std::vector<torch::Tensor> parameters) {
  return std::make_unique<torch::optim::SGD>(
      std::move(parameters), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
}

// Trains a copy of `model` on `device` and on the CPU for `steps` optimiser steps and
// expects the same parameters.
void expectTrainingEqualsCpu(
    const std::shared_ptr<torch::nn::Module>& model, const torch::Tensor& input,
    const std::function<torch::Tensor(const torch::Tensor&)>& loss,
    const std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&)>& forward,
    c10::Device device, int steps, const MakeOptimizer& makeOptimizer = sgd) {
  auto onCpu = model->clone();
  auto onEmu = model->clone();
  onEmu->to(device);
  for (const auto& p : onEmu->parameters()) {
    ASSERT_EQ(p.device(), device);
  }
  const auto cpuOptimizer = makeOptimizer(onCpu->parameters());
  const auto emuOptimizer = makeOptimizer(onEmu->parameters());
  torch::optim::Optimizer& cpuOpt = *cpuOptimizer;
  torch::optim::Optimizer& emuOpt = *emuOptimizer;
  const auto emuInput = input.to(device);
  for (int step = 0; step < steps; ++step) {
    cpuOpt.zero_grad();
    const auto cpuLoss = loss(forward(*onCpu, input));
    cpuLoss.backward();
    cpuOpt.step();
    emuOpt.zero_grad();
    const auto emuLoss = loss(forward(*onEmu, emuInput));
    EXPECT_EQ(emuLoss.device(), device);
    emuLoss.backward();
    emuOpt.step();
    EXPECT_NEAR(emuLoss.item<float>(), cpuLoss.item<float>(), 1e-5);
  }
  const auto cpuParams = onCpu->parameters();
  const auto emuParams = onEmu->parameters();
  ASSERT_EQ(cpuParams.size(), emuParams.size());
  for (size_t i = 0; i < cpuParams.size(); ++i) {
    EXPECT_TRUE(torch::allclose(emuParams[i].cpu(), cpuParams[i], 1e-5, 1e-6)) << "parameter " << i;
  }
}

TEST_F(EmuTraining, MlpTrainingStepsEqualTheCpu) {
  torch::manual_seed(7);
  auto mlp =
      torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  const auto input = torch::randn({12, 8});
  const auto target = torch::randn({12, 4});
  auto forward = [](torch::nn::Module& m, const torch::Tensor& x) {
    return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x);
  };
  auto loss = [&](const torch::Tensor& out) {
    return torch::mse_loss(out, target.to(out.device()));
  };
  expectTrainingEqualsCpu(mlp.ptr(), input, loss, forward, emuDevice(1), 3);
}

TEST_F(EmuTraining, ConvNetTrainingStepsEqualTheCpu) {
  torch::manual_seed(11);
  auto net =
      torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                            torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                            torch::nn::Flatten(), torch::nn::Linear(4 * 4 * 4, 3));
  const auto input = torch::randn({6, 3, 8, 8});
  const auto labels = torch::tensor({0, 1, 2, 0, 1, 2}, torch::kLong);
  auto forward = [](torch::nn::Module& m, const torch::Tensor& x) {
    return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x);
  };
  auto loss = [&](const torch::Tensor& out) {
    return torch::cross_entropy_loss(out, labels.to(out.device()));
  };
  expectTrainingEqualsCpu(net.ptr(), input, loss, forward, emuDevice(0), 3);
}

TEST_F(EmuTraining, AdamAndAdamWStepsEqualTheCpu) {
  torch::manual_seed(5);
  auto mlp =
      torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
  const auto input = torch::randn({10, 6});
  const auto target = torch::randn({10, 2});
  auto forward = [](torch::nn::Module& m, const torch::Tensor& x) {
    return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x);
  };
  auto loss = [&](const torch::Tensor& out) {
    return torch::mse_loss(out, target.to(out.device()));
  };
  expectTrainingEqualsCpu(mlp.ptr(), input, loss, forward, emuDevice(0), 3,
                          [](std::vector<torch::Tensor> p) {
                            return std::make_unique<torch::optim::Adam>(
                                std::move(p), torch::optim::AdamOptions(0.01).amsgrad(true));
                          });
  expectTrainingEqualsCpu(mlp.ptr(), input, loss, forward, emuDevice(1), 3,
                          [](std::vector<torch::Tensor> p) {
                            return std::make_unique<torch::optim::AdamW>(
                                std::move(p), torch::optim::AdamWOptions(0.01));
                          });
}

// Everything a rank on emu:1 does, done on a thread whose current device is emu:0 (a rank
// that never set its current device, as a Gloo rank on cuda:1 need not): a U-Net-like
// training step, and the segmentation metrics of the example trainer's evaluation.
// Nothing may take memory from emu:0.
TEST_F(EmuTraining, ARankOnEmu1NeverAllocatesOnTheCurrentDevice) {
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::PrivateUse1);
  auto allocationsOn0 = [&] { return allocator->getDeviceStats(0).num_device_alloc; };
  torch::manual_seed(13);
  auto net =
      torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)),
                            torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                            torch::nn::Upsample(torch::nn::UpsampleOptions()
                                                    .scale_factor(std::vector<double>{2, 2})
                                                    .mode(torch::kNearest)),
                            torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(4, 3, 1)));
  const c10::Device device = emuDevice(1);
  const auto before = allocationsOn0();
  std::thread rank([&] {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->setDevice(emuDevice(0));
    net->to(device);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int64_t batch : {4, 1, 2}) {
      const auto x = torch::randn({batch, 1, 8, 8}).to(device);
      const auto y = torch::randint(0, 3, {batch, 8, 8}, torch::kLong).to(device);
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
      loss.backward();
      opt.step();
      EXPECT_EQ(loss.device(), device);
      // The example U-Net trainer's evaluation sums (examples/unet/train_unet.cpp).
      torch::NoGradGuard noGrad;
      net->eval();
      const int64_t k = 3;
      auto logits = net->forward(x).to(at::kFloat);
      auto pred = logits.argmax(1);
      auto ids = torch::arange(k, y.options()).view({k, 1});
      auto p = pred.flatten().unsqueeze(0).eq(ids);
      auto t = y.flatten().unsqueeze(0).eq(ids);
      auto perClass = torch::stack({p.logical_and(t).sum(1), p.sum(1), t.sum(1)}, 1);
      auto sums = torch::cat(
          {torch::stack(
               {torch::nn::functional::cross_entropy(
                    logits, y,
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)),
                torch::scalar_tensor(static_cast<double>(y.numel()), logits.options()),
                pred.eq(y).sum().to(at::kFloat)}),
           perClass.flatten().to(at::kFloat)});
      auto total =
          torch::zeros({3 + 3 * k}, torch::TensorOptions().dtype(at::kDouble).device(device));
      total += sums.to(at::kDouble);
      total.div_(2);
      EXPECT_EQ(total.device(), device);
      EXPECT_GT(total.cpu()[1].item<double>(), 0);
      net->train();
    }
  });
  rank.join();
  EXPECT_EQ(allocationsOn0(), before) << "a rank on emu:1 took memory from emu:0";
}

// PowerSGD's arithmetic (--compress auto times it on each rank's device) runs on emu:
// error feedback, P = M Q, Gram-Schmidt (rank 1) and QR (rank 4) orthogonalisation,
// Q = M^T P, the approximation; its operators run on the device and its stretched time
// is what a slow card would report.
TEST_F(EmuTraining, PowerSgdsComputeRunsOnTheDeviceAndCountsItsSlowdown) {
  const std::vector<std::vector<int64_t>> shapes = {{64, 3, 3, 3}, {64}, {10, 64}};
  for (int rank : {1, 4}) {
    PowerSgdOptions o;
    o.rank = rank;
    resetCounters();
    const double seconds = timePowerSgdCompute(shapes, o, emuDevice(1));
    EXPECT_GT(seconds, 0.0) << "rank " << rank;
    const DeviceCounters c = counters(1);
    EXPECT_GT(c.ops, 20) << "the products ran on emu:1";
    EXPECT_EQ(counters(0).ops, 0) << "nothing ran on emu:0";
  }
  // A 10x slower card sleeps nine times its compute after each operator, inside the
  // timing. Not a bound on one pass against the slept total (a first pass that pays
  // one-time costs sleeps far more than the fastest one): the same warm timing at full
  // speed, which a 10x stretch leaves several times behind. Each the fastest of three,
  // taken in turns, so that a burst of load on the machine inflates neither alone (the
  // test also runs alone: tests/emu/CMakeLists.txt).
  PowerSgdOptions o;
  o.rank = 4;
  double full = std::numeric_limits<double>::max();
  double slow = std::numeric_limits<double>::max();
  double slept = 0;
  for (int round = 0; round < 3; ++round) {
    full = std::min(full, timePowerSgdCompute(shapes, o, emuDevice(1)));
    setSlowdown(1, 10.0);
    resetCounters();
    slow = std::min(slow, timePowerSgdCompute(shapes, o, emuDevice(1)));
    slept += counters(1).slowdownSeconds;
    setSlowdown(1, 1.0);
  }
  EXPECT_GT(slept, 0.0);
  EXPECT_GT(slow, 2.0 * full) << "full speed " << full << " s, 10x slower " << slow << " s";
}

}  // namespace
}  // namespace testing
}  // namespace emu
}  // namespace hddp
