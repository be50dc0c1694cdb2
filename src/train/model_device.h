// The device a rank trains on: its model's (private to the train layer).
#pragma once

#include <c10/core/Device.h>

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

}  // namespace train
}  // namespace hddp
