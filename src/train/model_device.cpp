#include "train/model_device.h"

#include <torch/nn/module.h>

#include <optional>
#include <string>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"

namespace hddp {
namespace train {

// The rank's device is where its model is: what InitOptions::device, --device,
// HDDP_DEVICE or the launcher chose, and the model was moved to. Not the communicator's
// device, which under Gloo is the CPU (where it stages tensors) whatever the rank
// computes on. A model without tensors computes where the communicator is.
c10::Device modelDevice(const torch::nn::Module* model, const Communicator& comm) {
  if (model == nullptr) {
    return comm.device();
  }
  std::optional<c10::Device> device;
  std::string first;
  for (const auto& tensors :
       {model->named_parameters(/*recurse=*/true), model->named_buffers(/*recurse=*/true)}) {
    for (const auto& item : tensors) {
      const at::Tensor& t = item.value();
      if (!device) {
        device = t.device();
        first = item.key();
      }
      HDDP_CHECK_AS(ConfigError, t.device() == *device, "Trainer: the model is on more than one ",
                    "device (", first, " on ", device->str(), ", ", item.key(), " on ",
                    t.device().str(), "); move the whole model (net->to(device)) to the rank's ",
                    "device first");
    }
  }
  return device.value_or(comm.device());
}

}  // namespace train
}  // namespace hddp
