// Communication hooks: what DistributedDataParallel sends for each gradient bucket, in
// the shape of PyTorch's `register_comm_hook` (a bucket in, the pending reduction of
// the bucket out).
//
// DDP hands each bucket to the hook as soon as its gradients are ready, in bucket order
// on every rank, and keeps the returned Work. At the end of backward it waits for every
// bucket's Work, then calls its `finish`, after which the bucket's buffer must hold the
// SUM over ranks of every rank's buffer. DDP has already weighted each rank's gradients
// by its share (b_r / B), so a sum is the gradient of the whole global batch; a hook
// must not average. A hook may reduce a different tensor than the buffer (a compressed
// copy, a low-rank factor) and write the result back in `finish`.
//
//   hddp::DdpOptions options;
//   options.commHook = hddp::compressedAllreduceHook(at::kBFloat16);
//   // or your own:
//   options.commHook = [](hddp::Communicator& comm, hddp::GradBucket& bucket) {
//     return hddp::CommHookResult{comm.allreduce(bucket.buffer), nullptr};
//   };
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <functional>

#include "hddp/comm/communicator.h"
#include "hddp/comm/work.h"

namespace hddp {

/// One gradient bucket handed to a communication hook.
struct GradBucket {
  /// The bucket's index; buckets are handed over in index order on every rank.
  int index = 0;
  /// The flat buffer of this rank's weighted gradients (and DDP's bookkeeping elements,
  /// which must be summed like the rest). Contiguous, on the communicator's device.
  at::Tensor buffer;
};

/// The pending reduction of a bucket.
struct CommHookResult {
  /// The collective(s) in flight; DDP waits on it at the end of backward.
  Work work;
  /// Runs after `work` completed, on the training thread; writes the reduced values into
  /// the bucket's buffer when the hook reduced another tensor. May be empty.
  std::function<void()> finish;
};

/// Starts the reduction of one bucket (see the top of this file for the contract).
using CommHook = std::function<CommHookResult(Communicator& communicator, GradBucket& bucket)>;

/// The default: an allreduce (sum) of the buffer in place.
CommHook allreduceHook();

/// Casts the buffer to `wire` (at::kHalf or at::kBFloat16) for the allreduce and back:
/// half the bytes. float16 keeps ~3 significant digits and overflows beyond 65504;
/// bfloat16 keeps float32's range with ~2-3 digits. As PyTorch's fp16_compress_hook and
/// bf16_compress_hook. ConfigError for another type.
CommHook compressedAllreduceHook(c10::ScalarType wire);

}  // namespace hddp
