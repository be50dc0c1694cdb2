// hddp::emu: autograd and an optimiser on emu give the CPU's result.

#include "emu_fixture.h"

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

}  // namespace
}  // namespace testing
}  // namespace emu
}  // namespace hddp
