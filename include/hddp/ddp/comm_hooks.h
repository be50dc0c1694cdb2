// Communication hooks: what DistributedDataParallel sends for each gradient bucket, in
// the shape of PyTorch's `register_comm_hook` (a bucket in, the pending reduction of
// the bucket out).
//
// The contract:
// - DDP hands each bucket to the hook as soon as its gradients are ready, in bucket
//   order on every rank (so every rank issues the same collectives in the same order),
//   and keeps the returned Work.
// - `bucket.buffer` holds this rank's gradients of `bucket.parameters` and nothing
//   else: DDP's own bookkeeping (the step's status) travels outside what the hook
//   reduces, so a hook may reduce the buffer any way it likes (a low-rank factor, a
//   subset).
// - At the end of backward DDP waits for every bucket's Work; then, in bucket order,
//   it calls each bucket's `then` (a second round of collectives, e.g. PowerSGD's Q)
//   and waits for those; then it calls each `finish`. After `finish` the buffer must
//   hold the SUM over ranks of every rank's buffer, or the hook's approximation of it.
// - DDP has already weighted each rank's gradients by its share (b_r / B), so a sum is
//   the gradient of the whole global batch: a hook must not average.
//
//   hddp::DdpOptions options;
//   options.commHook = hddp::compressedAllreduceHook(at::kBFloat16);
//   // or your own:
//   options.commHook = [](hddp::Communicator& comm, hddp::GradBucket& bucket) {
//     return hddp::CommHookResult{comm.allreduce(bucket.buffer), nullptr};
//   };
//
// Hooks that need more than one round of communication set `then`; hddp/ddp/power_sgd.h
// (PowerSGD) is one.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/comm/work.h"

namespace hddp {

/// One gradient bucket handed to a communication hook (c10d's GradBucket).
struct GradBucket {
  /// The bucket's index; buckets are handed over in index order on every rank. DDP lays
  /// its buckets out anew after its first step (in the order the gradients became
  /// ready), so the parameters behind an index may change then: a hook that keeps state
  /// across steps keys it by `names`, not by the index.
  int index = 0;
  /// The last bucket of the step (c10d's is_last()): a hook that counts steps counts here.
  bool isLast = false;
  /// The flat buffer of this rank's weighted gradients of `parameters`, in order, each
  /// at its offset. Contiguous, on the communicator's device.
  at::Tensor buffer;
  /// The parameters whose gradients the buffer holds (c10d's parameters()).
  std::vector<at::Tensor> parameters;
  /// Where each parameter's gradient starts in `buffer`, in elements.
  std::vector<int64_t> offsets;
  /// Each parameter's name in the model (DDP's; empty for a bucket made by hand).
  std::vector<std::string> names;

  /// Each parameter's gradient as a view of `buffer`, shaped as the parameter (c10d's
  /// gradients()): writing into a view writes into the buffer.
  std::vector<at::Tensor> gradients() const;
};

struct CommHookResult;

/// A second round of communication, started at the end of backward after the first
/// round of every bucket completed (see the top of this file).
using CommHookThen = std::function<CommHookResult()>;

/// The pending reduction of a bucket.
struct CommHookResult {
  /// The collective(s) in flight; DDP waits on it at the end of backward.
  Work work;
  /// Runs after `work` completed (and after `then`'s work, when set), on the training
  /// thread; writes the reduced values into the bucket's buffer when the hook reduced
  /// another tensor. May be empty.
  std::function<void()> finish;
  /// May be empty. Called after every bucket's `work` completed, in bucket order on
  /// every rank; returns the second round, whose `work` DDP waits on and whose `finish`
  /// runs after this result's `finish`. Its own `then` must be empty.
  CommHookThen then;
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
