// A rank computes on its own device, whatever device its communicator stages tensors on
// (issue #33): the Trainer on an emulated accelerator (hddp::emu) next to a CPU rank,
// under Gloo, trains to the all-CPU run's parameters; Gloo stages device tensors.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/comm/devices.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/emulated_device.h"
#include "support/ranks.h"

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(6));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(torch::relu(bn->forward(conv->forward(x))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// Two ranks on `devices`, 8 steps of momentum SGD over an uneven fixed split; rank 0's
// parameters and buffers afterwards, on the CPU.
std::vector<at::Tensor> trainOn(const std::vector<c10::Device>& devices, int64_t steps = 8,
                                const std::string& saveDir = "", bool resume = false) {
  std::vector<at::Tensor> result;
  std::vector<c10::Device> trained(devices.size(), c10::Device(c10::kCPU));
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);  // Gloo
    Net model(nullptr);
    {
      // The ranks are threads of one process: the global RNG must not be drawn from by
      // two of them at once, or rank 0's initial weights (which DDP broadcasts) differ.
      static std::mutex rng;
      std::lock_guard<std::mutex> lock(rng);
      torch::manual_seed(7);
      model = Net();
    }
    model->to(devices[static_cast<size_t>(rank)]);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    hddp::TrainerOptions o;
    o.globalBatch = 24;
    o.maxSteps = steps;
    o.saveDir = saveDir;
    o.saveEvery = saveDir.empty() ? 0 : 4;
    if (resume) {
      o.resume = saveDir;
    }
    o.balance = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 2;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(96, 1, 8, 4, /*seed=*/1);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    trained[static_cast<size_t>(rank)] = trainer.device();
    trainer.fit();
    // Every momentum buffer lies where its parameter does (resumed ones too).
    for (const auto& p : model->parameters()) {
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      ASSERT_NE(it, opt.state().end());
      const auto& state = static_cast<const torch::optim::SGDParamState&>(*it->second);
      EXPECT_EQ(state.momentum_buffer().device(), p.device()) << "rank " << rank;
    }
    if (rank == 0) {
      for (const auto& p : model->parameters()) {
        EXPECT_EQ(p.device(), devices[0]) << "the model stays on the rank's device";
        result.push_back(p.detach().cpu().clone());
      }
      for (const auto& b : model->buffers()) {
        result.push_back(b.detach().cpu().clone());
      }
    }
  });
  EXPECT_EQ(trained, devices) << "each rank trains on its model's device";
  return result;
}

// The advertised `hddp-run --devices cuda:0,cpu` case, on an emulated device: before,
// the Trainer took its device from the communicator (the CPU under Gloo) and fed CPU
// batches to a model on the device, which fails at the first forward (on a GPU, and on
// emu, which refuses mixed devices as CUDA does).
TEST(Trainer, TrainsOnTheRanksDeviceNotTheCommunicators_Emu) {
  const c10::Device emu = hddp::testing::emulatedDevice(0);
  const c10::Device cpu(c10::kCPU);
  const auto onCpu = trainOn({cpu, cpu});
  const auto mixed = trainOn({emu, cpu});
  ASSERT_EQ(onCpu.size(), mixed.size());
  for (size_t i = 0; i < onCpu.size(); ++i) {
    EXPECT_TRUE(torch::allclose(onCpu[i].to(at::kDouble), mixed[i].to(at::kDouble), 1e-4, 1e-5))
        << "tensor " << i << ": " << (onCpu[i] - mixed[i]).abs().max();
  }
  hddp::emu::checkNoViolations();
}

// A state file holds rank 0's optimizer state on rank 0's device. Resumed, every rank
// gets it on its own device: before, rank 1 (emu:1) got momentum buffers on the device
// they were saved from, and its first step mixed two devices (a GPU's cuda:0 and cuda:1
// under NCCL alike). The resumed run ends where the run straight through does.
TEST(Trainer, AResumedRankGetsTheOptimizerStateOnItsOwnDevice_Emu) {
  const std::vector<c10::Device> devices{hddp::testing::emulatedDevice(0),
                                         c10::Device(c10::DeviceType::PrivateUse1, 1)};
  const auto straight = trainOn(devices, 8);
  const std::string dir = hddp::testing::makeTempDir();
  trainOn(devices, 4, dir);
  const auto resumed = trainOn(devices, 8, dir, /*resume=*/true);
  ASSERT_EQ(straight.size(), resumed.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(
        torch::allclose(straight[i].to(at::kDouble), resumed[i].to(at::kDouble), 1e-5, 1e-6))
        << "tensor " << i;
  }
  hddp::emu::checkNoViolations();
}

// A rank's thread whose current device is not the rank's (a Gloo rank on cuda:1 or emu:1
// that never set it): while the Trainer works, the rank's device is current, so what
// takes the current device (here an index-less factory in the user's evaluation) lands
// there, and the thread's own device is back afterwards. Before, it landed on emu:0.
TEST(Trainer, TheRanksDeviceIsCurrentWhileTheTrainerWorks_Emu) {
  const c10::Device emu1(c10::DeviceType::PrivateUse1, 1);
  hddp::testing::emulatedDevice(0);  // installs emu
  auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::PrivateUse1);
  const auto allocationsOn0 = allocator->getDeviceStats(0).num_device_alloc;
  hddp::testing::runThreads(1, [&](int rank, int size, hddp::Store& store) {
    guard->setDevice(c10::Device(c10::DeviceType::PrivateUse1, 0));
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net model;
    model->to(emu1);
    torch::optim::SGD opt(model->parameters(), 0.05);
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.maxSteps = 2;
    o.progress = hddp::ProgressMode::Off;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(16, 1, 8, 4, /*seed=*/1);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    EXPECT_EQ(guard->getDevice().index(), 0) << "the thread's device is back after construction";
    std::vector<c10::Device> seen;
    trainer.setEvaluation([&](int64_t) -> std::map<std::string, double> {
      seen.push_back(guard->getDevice());
      seen.push_back(
          at::zeros({3}, at::TensorOptions().device(c10::DeviceType::PrivateUse1)).device());
      return {};
    });
    trainer.fit();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[0], emu1) << "the current device during fit()";
    EXPECT_EQ(seen[1], emu1) << "an index-less factory in the evaluation";
    EXPECT_EQ(guard->getDevice().index(), 0) << "the thread's device is back after fit()";
  });
  EXPECT_EQ(allocator->getDeviceStats(0).num_device_alloc, allocationsOn0)
      << "a rank on emu:1 took memory from emu:0";
  hddp::emu::checkNoViolations();
}

// The Trainer's device is its model's: a model split over two devices is refused with
// both named.
TEST(Trainer, AModelOnTwoDevicesIsRefusedNamingBoth_Emu) {
  const c10::Device emu = hddp::testing::emulatedDevice(0);
  hddp::testing::runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net model;
    model->fc->to(emu);
    torch::optim::SGD opt(model->parameters(), 0.05);
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.progress = hddp::ProgressMode::Off;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(16, 1, 8, 4, /*seed=*/1);
    try {
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt,
                            ds, o);
      ADD_FAILURE() << "a model on cpu and emu:0 was accepted";
    } catch (const hddp::ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("on cpu"), std::string::npos) << what;
      EXPECT_NE(what.find("on emu:0"), std::string::npos) << what;
    }
  });
}

// Gloo reduces host memory: a rank's tensors on an emulated device are staged through
// it (copied to the host before the collective and back when it completes), next to a
// rank whose tensors are on the CPU; the Avg division happens before the copy back.
TEST(Communicator, GlooStagesEmulatedDeviceTensors_Emu) {
  const c10::Device emu = hddp::testing::emulatedDevice(1);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    const c10::Device device = rank == 0 ? emu : c10::Device(c10::kCPU);
    auto comm = hddp::makeCommunicator(store, rank, size);
    const auto on = torch::TensorOptions().device(device);
    auto t = torch::full({1000}, float(rank + 1), on);
    // synchronize() waits for Gloo as wait() does (its completion runs on the host).
    comm->allreduce(t, {hddp::ReduceOp::Avg}).synchronize();
    EXPECT_EQ(t.device(), device);
    EXPECT_TRUE(t.cpu().equal(torch::full({1000}, 1.5f)));
    std::vector<at::Tensor> parts{torch::full({3}, float(rank), on), torch::full({2, 2}, 1.0f, on)};
    comm->allreduceCoalesced(parts).wait();
    EXPECT_TRUE(parts[0].cpu().equal(torch::full({3}, 1.0f)));
    EXPECT_TRUE(parts[1].cpu().equal(torch::full({2, 2}, 2.0f)));
    auto b = rank == 0 ? torch::arange(16, on).to(at::kFloat) : torch::zeros({16}, on);
    comm->broadcast(b, 0).wait();
    EXPECT_TRUE(b.cpu().equal(torch::arange(16).to(at::kFloat)));
    std::vector<at::Tensor> gathered{torch::empty({2}, on), torch::empty({2}, on)};
    comm->allgather(gathered, torch::full({2}, float(10 * rank), on)).wait();
    EXPECT_TRUE(gathered[0].cpu().equal(torch::full({2}, 0.0f)));
    EXPECT_TRUE(gathered[1].cpu().equal(torch::full({2}, 10.0f)));
    EXPECT_EQ(gathered[1].device(), device);
    auto out = torch::empty({2}, on);
    comm->reduceScatter(out, torch::arange(4, on).to(at::kFloat)).wait();
    EXPECT_TRUE(out.cpu().equal(torch::arange(4).to(at::kFloat).narrow(0, 2 * rank, 2) * 2));
  });
  hddp::emu::checkNoViolations();
}

// A rank's device may name the emulated accelerator once it is installed; its index is
// checked against emu's device count.
TEST(Devices, AnEmulatedDeviceIsParsedAndChecked_Emu) {
  hddp::testing::emulatedDevice(0);
  EXPECT_EQ(hddp::parseDeviceName("emu:1", "--device"),
            c10::Device(c10::DeviceType::PrivateUse1, 1));
  const auto list = hddp::parseDeviceList("emu:0,cpu", "HDDP_DEVICE");
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].str(), "emu:0");
  hddp::LaunchInfo info;
  try {
    hddp::resolveDevice(info, c10::Device(c10::DeviceType::PrivateUse1, 5), {}, 0, false);
    ADD_FAILURE() << "emu:5 of 2 devices was accepted";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("2 emu device(s)"), std::string::npos) << e.what();
  }
}

// Without hddp::emu installed, a device naming it says what to do.
TEST(Devices, AnEmulatedDeviceWithoutTheEmulatorSaysHowToInstallIt) {
  if (hddp::emu::isInstalled()) {
    GTEST_SKIP() << "emu was installed by an earlier test of this process (ctest runs each "
                    "test alone)";
  }
  try {
    hddp::parseDeviceName("emu:0", "--device");
    ADD_FAILURE() << "emu:0 was accepted without the emulator";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("hddp::emu::install()"), std::string::npos) << e.what();
  }
}

// A rank next to one on emu need not install emu (a CUDA rank must not: it would lose
// CUDA's pinned memory): its own entry of HDDP_DEVICE is parsed, the others' emu names
// are accepted as written. Its own entry naming emu still asks for the install.
TEST(Devices, AnotherRanksEmulatedDeviceNeedsNoEmulatorHere) {
  if (hddp::emu::isInstalled()) {
    GTEST_SKIP() << "emu was installed by an earlier test of this process (ctest runs each "
                    "test alone)";
  }
  hddp::LaunchInfo info;
  info.localWorldSize = 2;
  info.localRank = 1;
  const hddp::EnvMap env{{"HDDP_DEVICE", "emu:0,cpu"}};
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, env, 0, false), c10::Device(c10::kCPU));
  info.localRank = 0;
  try {
    hddp::resolveDevice(info, std::nullopt, env, 0, false);
    ADD_FAILURE() << "emu:0 was accepted for this rank without the emulator";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("hddp::emu::install()"), std::string::npos) << e.what();
  }
}

}  // namespace
