#include "hddp/core/autocast.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/core/error.h"
#include "support/emulated_device.h"

namespace {

TEST(Autocast, LinearOutputsBFloat16OnCpuAndStateIsRestored) {
  torch::nn::Linear linear(8, 4);
  auto x = torch::randn({2, 8});
  ASSERT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  {
    hddp::AutocastGuard guard(c10::kCPU);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat32);
}

TEST(Autocast, NestedGuardsRestoreTheEnclosingState) {
  torch::nn::Linear linear(8, 4);
  auto x = torch::randn({2, 8});
  const auto dtypeBefore = at::autocast::get_autocast_dtype(at::kCPU);
  {
    hddp::AutocastGuard outer(c10::kCPU);
    {
      hddp::AutocastGuard inner(c10::kCPU, std::nullopt, /*enabled=*/false);
      EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
      EXPECT_EQ(linear(x).scalar_type(), torch::kFloat32);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    {
      hddp::AutocastGuard inner(c10::kCPU, c10::kHalf);
      EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), c10::kHalf);
    }
    EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), c10::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), dtypeBefore);
}

TEST(Autocast, RejectsNonReducedPrecisionDtype) {
  EXPECT_THROW(hddp::AutocastGuard(c10::kCPU, c10::kFloat), hddp::Error);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

TEST(Autocast, DefaultDtypes) {
  EXPECT_EQ(hddp::AutocastGuard::defaultDtype(c10::kCPU), c10::kBFloat16);
  EXPECT_EQ(hddp::AutocastGuard::defaultDtype(c10::kCUDA), c10::kHalf);
}

void fp16Linear(const c10::Device& device) {
  torch::nn::Linear linear(8, 4);
  linear->to(device);
  auto x = torch::randn({2, 8}).to(device);
  {
    hddp::AutocastGuard guard(device.type());
    EXPECT_EQ(linear(x).scalar_type(), torch::kHalf);
  }
  {
    hddp::AutocastGuard guard(device.type(), c10::kBFloat16);
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat32);
}

TEST(Autocast, Fp16Linear_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  fp16Linear(c10::Device(c10::kCUDA, 0));
}

// An accelerator LibTorch knows besides CUDA (here hddp::emu, a PrivateUse1 backend)
// gets autocast too; the guard refused every device but CPU and CUDA before.
TEST(Autocast, Fp16Linear_Emu) {
  const c10::Device device = hddp::testing::emulatedDevice(0);
  EXPECT_EQ(hddp::AutocastGuard::defaultDtype(device.type()), c10::kHalf);
  fp16Linear(device);
}

}  // namespace
