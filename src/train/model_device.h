// The device a rank trains on: its model's (private to the train layer).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace hddp {
class Communicator;
namespace train {

/// Where every parameter and buffer of `model` is; the communicator's device for a model
/// without tensors (or none). ConfigError naming two tensors on different devices.
c10::Device modelDevice(const torch::nn::Module* model, const Communicator& comm);

/// Makes the rank's device the calling thread's current device for the scope (what
/// torch.cuda.set_device does for a script), and restores the previous one after. A rank
/// on cuda:1 (or emu:1) whose thread still has device 0 current would otherwise put every
/// allocation that takes the current device (an index-less factory in a user's evaluation,
/// a library's scratch tensor) and, on a GPU, a CUDA context on another rank's card.
class RankDeviceScope {
 public:
  explicit RankDeviceScope(c10::Device device) {
    if (!device.is_cpu()) {
      guard_.reset_device(device);
    }
  }

 private:
  c10::OptionalDeviceGuard guard_;
};

}  // namespace train
}  // namespace hddp
