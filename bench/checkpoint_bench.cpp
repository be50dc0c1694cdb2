// Peak memory and time per training step with and without activation checkpointing,
// one JSON line. CPU: peak resident memory above the level before the first step
// (VmHWM after resetting it through /proc/self/clear_refs). CUDA: peak allocated bytes
// of the caching allocator. Run each configuration in its own process:
//   checkpoint_bench --model resnet18 --checkpoint 1 --batch 32
// bench/checkpoint_compare.py runs the pairs and prints the ratios.
#include <ATen/Parallel.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "hddp/hddp.h"
#include "resnet.h"
#include "unet.h"

namespace {

int64_t statusKiB(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::stoll(line.substr(field.size() + 1));
    }
  }
  return -1;
}

void resetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

}  // namespace

int main(int argc, char** argv) {
  std::string model = "resnet18";
  int checkpointing = 0;
  int64_t batch = 32;
  int steps = 3;
  int threads = 2;
  std::string device = "cpu";
  int64_t image = 0;
  CLI::App app{"activation checkpointing: peak memory and time per step"};
  app.add_option("--model", model, "resnet18, resnet50, resnet56 or unet")->capture_default_str();
  app.add_option("--checkpoint", checkpointing, "1 = checkpoint each block")->capture_default_str();
  app.add_option("--batch", batch, "Batch size")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps (after one warm-up step)")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads")->capture_default_str();
  app.add_option("--device", device, "cpu or cuda")->capture_default_str();
  app.add_option("--image", image, "Image side (default 32 for ResNet, 128 for U-Net)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);
  const torch::Device dev(device);
  torch::manual_seed(0);

  std::shared_ptr<torch::nn::Module> net;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  torch::Tensor x;
  torch::Tensor y;
  if (model == "unet") {
    hddp::models::UNetOptions o;
    o.checkpointActivations = checkpointing != 0;
    hddp::models::UNet unet(o);
    net = unet.ptr();
    forward = [unet](const torch::Tensor& in) mutable { return unet->forward(in); };
    const int64_t side = image > 0 ? image : 128;
    x = torch::randn({batch, 1, side, side});
    y = torch::randint(0, 2, {batch, side, side}, torch::kLong);
  } else {
    hddp::models::ResNetOptions o;
    o.arch = model;
    o.checkpointActivations = checkpointing != 0;
    o.imageSize = image > 0 ? image : 32;
    hddp::models::ResNet resnet(o);
    net = resnet.ptr();
    forward = [resnet](const torch::Tensor& in) mutable { return resnet->forward(in); };
    x = torch::randn({batch, 3, o.imageSize, o.imageSize});
    y = torch::randint(0, 10, {batch}, torch::kLong);
  }
  net->to(dev);
  x = x.to(dev);
  y = y.to(dev);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto step = [&] {
    opt.zero_grad();
    torch::cross_entropy_loss(forward(x), y).backward();
    opt.step();
  };
  // The peak is taken over the first step too (it allocates the gradients and the
  // optimizer state, the same in both configurations): with glibc keeping freed
  // memory resident, a baseline taken after a warm-up step would hide the peak.
  int64_t baseline = 0;
  c10::DeviceAllocator* allocator = dev.is_cuda() ? c10::getDeviceAllocator(c10::kCUDA) : nullptr;
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  if (allocator) {
    torch::cuda::synchronize();
    allocator->resetPeakStats(dev.index() < 0 ? 0 : dev.index());
    baseline = allocator->getDeviceStats(dev.index() < 0 ? 0 : dev.index())
                   .allocated_bytes[aggregate]
                   .current;
  } else {
    resetPeakRss();
    baseline = statusKiB("VmRSS") * 1024;
  }
  step();  // first step: counted for memory, not for time
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) {
    step();
  }
  if (allocator) {
    torch::cuda::synchronize();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  int64_t peak = 0;
  if (allocator) {
    peak = allocator->getDeviceStats(dev.index() < 0 ? 0 : dev.index())
               .allocated_bytes[aggregate]
               .peak;
  } else {
    peak = statusKiB("VmHWM") * 1024;
  }
  std::printf(
      "{\"model\": \"%s\", \"checkpoint\": %d, \"device\": \"%s\", \"batch\": %lld, "
      "\"seconds_per_step\": %.6f, \"peak_bytes_above_baseline\": %lld, \"measure\": \"%s\"}\n",
      model.c_str(), checkpointing, device.c_str(), static_cast<long long>(batch), seconds,
      static_cast<long long>(peak - baseline), allocator ? "cuda peak allocated" : "cpu peak RSS");
  return 0;
}
