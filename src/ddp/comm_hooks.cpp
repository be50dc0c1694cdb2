#include "hddp/ddp/comm_hooks.h"

#include <ATen/ATen.h>

#include "hddp/core/error.h"

namespace hddp {

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
