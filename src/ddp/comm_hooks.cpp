#include "hddp/ddp/comm_hooks.h"

#include <ATen/ATen.h>

#include "hddp/core/error.h"

namespace hddp {

std::vector<at::Tensor> GradBucket::gradients() const {
  HDDP_CHECK(parameters.size() == offsets.size(), "GradBucket: ", parameters.size(),
             " parameters but ", offsets.size(), " offsets");
  std::vector<at::Tensor> views;
  views.reserve(parameters.size());
  for (size_t i = 0; i < parameters.size(); ++i) {
    views.push_back(
        buffer.narrow(0, offsets[i], parameters[i].numel()).view(parameters[i].sizes()));
  }
  return views;
}

CommHook allreduceHook() {
  return [](Communicator& communicator, GradBucket& bucket) {
    return CommHookResult{communicator.allreduce(bucket.buffer), nullptr};
  };
}

CommHook compressedAllreduceHook(c10::ScalarType wire) {
  HDDP_CHECK_AS(ConfigError, wire == at::kHalf || wire == at::kBFloat16,
                "compressedAllreduceHook: the wire type must be Half or BFloat16, got ", wire);
  return [wire](Communicator& communicator, GradBucket& bucket) {
    at::Tensor onWire = bucket.buffer.to(wire);
    at::Tensor buffer = bucket.buffer;
    Work work = communicator.allreduce(onWire);
    return CommHookResult{std::move(work), [buffer, onWire]() mutable { buffer.copy_(onWire); }};
  };
}

}  // namespace hddp
