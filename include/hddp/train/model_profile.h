// A model's profile for what-if planning (hddp/balance/what_if.h), taken from the model
// itself: no figure is typed in.
//
//   FLOPs        every convolution and matrix product the training step dispatches
//                (aten::convolution, convolution_backward, mm, addmm, bmm, baddbmm),
//                counted from their shapes by a RecordFunction observer: 2 per
//                multiply-add, the backward's own products included
//   activations  the CPU allocator's live bytes during forward and backward, reported to
//                a memory observer, at two batch sizes: the peak's growth per sample,
//                under the profile's precision (autocast bf16 on the CPU for either AMP
//                mode: fp16 and bf16 take the same bytes)
//   parameters   the fp32 weights' bytes (the gradients each step allreduces)
//   calibration  optional: median training-step times (forward, backward, SGD update)
//                at two batch sizes on the device at hand, as fixed + perSample x b;
//                what-if scales them to other cards by the table's peak ratios
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <string>
#include <vector>

#include "hddp/balance/what_if.h"

namespace hddp {

struct ProfileOptions {
  std::string model;                 // the profile's name, e.g. "resnet50 3x224x224"
  std::vector<int64_t> sampleShape;  // one input sample, e.g. {3, 224, 224}
  AmpMode amp = AmpMode::Off;
  /// Memory is measured at this batch and twice it.
  int64_t memoryBatch = 2;
  /// Input bytes per sample the loader moves; 0 = the fp32 sample's bytes.
  double inputBytesPerSample = 0.0;
  /// Calibration: the device-table key of `device` ("" = no calibration), the batch
  /// (the step is also timed at half of it) and the steps timed at each size.
  std::string calibrateOn;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t calibrationBatch = 32;
  int calibrationSteps = 5;
  /// Moves the model (weights and buffers) to a device, e.g. `[&](auto d) { net->to(d); }`;
  /// the calibration moves it to `device` and back to the CPU. Without it only the
  /// parameters move (a model without buffers).
  std::function<void(const c10::Device&)> moveTo;
};

/// The model's forward pass on a batch; the profile backpropagates the mean of its
/// output (floating point) as the loss.
using ForwardFn = std::function<at::Tensor(const at::Tensor&)>;

/// FLOPs of one forward and one backward of `forward` on `input`.
struct FlopCount {
  double forward = 0.0;
  double backward = 0.0;
};
FlopCount countFlops(const ForwardFn& forward, const at::Tensor& input);

/// The profile of the model `forward` runs, whose weights are `parameters` (on the
/// CPU; moved to options.device for a calibration and back). ConfigError for an empty
/// sample shape or a non-positive batch.
ModelProfile profileModel(const ForwardFn& forward, const std::vector<at::Tensor>& parameters,
                          const ProfileOptions& options);

}  // namespace hddp
