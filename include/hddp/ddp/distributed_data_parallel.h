// DistributedDataParallel: the C++ port of PyTorch's DDP, extended to unequal local
// batches with exactly weighted gradients.
//
// Each step every rank tells the engine its local batch b_i and the global batch B
// (setBatch). During backward, every incoming gradient is scaled by b_i / B as it
// arrives, gradients are packed into buckets (reverse parameter order, a small first
// bucket, then up to 25 MiB, as PyTorch), and each bucket is allreduced (SUM) as soon
// as its last gradient is ready, overlapping communication with the rest of backward.
// When backward ends the engine waits for the buckets, so after `loss.backward()`
// returns, every rank holds the gradient of the mean loss over all B samples: the
// gradient of single-device training on the concatenated batch, whatever the split.
//
//   hddp::DistributedDataParallel ddp(model, *ctx.communicator);
//   for (...) {
//     ddp.setBatch(x.size(0), globalBatch);
//     optimizer.zero_grad();
//     auto loss = torch::nll_loss(model->forward(x), y);   // mean over the local batch
//     loss.backward();                                    // gradients synchronized here
//     optimizer.step();
//   }
//
// A rank with no samples in a step (b_i = 0) calls `ddp.setBatch(0, B)` and then
// `ddp.finalize()` instead of backward; it contributes zeros and receives the others'
// gradients. (A rank that runs forward and backward on an empty batch also contributes
// exact zeros: a zero share's gradients are replaced by zeros, never NaN x 0.)
// Gradient accumulation: inside `auto guard = ddp.noSync();` backward only
// accumulates (still weighted); the next synchronized backward communicates once.
// Pass each micro-step's own b and the B of the whole optimizer step.
// Two synchronized backwards without clearing the gradients in between
// (`loss1.backward(); loss2.backward();`) give PyTorch's result: each backward's
// gradient is reduced once and the two add up.
//
// The model is passed as LibTorch programs hold it: a module object
// (`struct Net : torch::nn::Module {...}; Net model;`), a std::shared_ptr to one, or a
// module holder (torch::nn::Linear, a TORCH_MODULE type). A holder or a shared_ptr is
// shared; a module object is referenced, not copied or owned (as torch::optim keeps
// `model.parameters()`): it must outlive the DistributedDataParallel.
//
// The module's parameters must all be on one device (ConfigError otherwise). Tied
// parameters (one tensor registered under several names) are synchronized once.
// Sparse gradients (Embedding with sparse=true) are made dense for the allreduce.
// Hooks live in each parameter's autograd metadata, so Module::load() after wrapping
// keeps them.
//
// Not thread-safe: one training loop per instance. The communicator must outlive it.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/comm_hooks.h"
#include "hddp/ddp/power_sgd.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace hddp {

enum class BufferSync {
  /// Buffers (e.g. BatchNorm running statistics) become the sample-weighted mean over
  /// ranks (see syncBuffers()) together with the gradients, every `bufferSyncInterval`
  /// steps, at the end of backward: no second synchronisation point per step. Default.
  WithGradients,
  /// PyTorch's place for it: call `syncBuffers()` before each forward. Costly with unlike
  /// ranks: it serialises the slow rank's work after the allreduce with the fast
  /// rank's compute.
  BeforeForward,
  /// Never synchronise buffers after construction.
  None,
};

/// Shorthands for the compression hooks of hddp/ddp/comm_hooks.h.
enum class GradCompression {
  None,
  /// Buckets are cast to float16 for the allreduce and back (half the bytes on the
  /// wire; ~3 significant digits per element, values beyond 65504 overflow).
  Fp16,
  /// Buckets are cast to bfloat16 (half the bytes, float32's range, ~2-3 digits).
  Bf16,
  /// PowerSGD low-rank compression with error feedback (hddp/ddp/power_sgd.h), with
  /// DdpOptions::powerSgd; its state is DistributedDataParallel::powerSgdState().
  PowerSgd,
  /// The Trainer picks one of the above from the slowest link and the backward time it
  /// can hide behind, and logs why (hddp/balance/compression_model.h). The Trainer
  /// resolves it before it builds DDP; DistributedDataParallel itself rejects it (call
  /// chooseCompression and set the choice).
  Auto,
};

struct DdpOptions {
  /// Cap of the first bucket (the last gradients of backward). Default 1 MiB, as PyTorch.
  int64_t firstBucketBytes = 1 << 20;
  /// Cap of the other buckets. Default 25 MiB, as PyTorch.
  int64_t bucketCapBytes = 25 << 20;
  /// Rebuild the buckets once, after the first step, from the order in which
  /// gradients actually became ready (rank 0's order, shared). Default true.
  bool rebuildBuckets = true;
  /// Parameters that get no gradient in a step are allowed instead of an error, with
  /// PyTorch's find_unused_parameters=True semantics. For a parameter it did not use (in
  /// the step's backward nor in a noSync() micro-step before it) a rank sends its .grad
  /// as it is (zeros if undefined). One that some rank used gets the reduced gradient on
  /// every rank; one that no rank used keeps its .grad as it was on every rank (undefined
  /// stays undefined, so the optimizer skips it: no weight decay, no momentum; zeros after
  /// zero_grad(false) stay zeros). The used flags travel in one allreduce of one int per
  /// parameter after the last bucket. With gradientAsBucketView PyTorch leaves a defined
  /// .grad of such a parameter as the average over ranks of what each rank held; hddp
  /// restores each rank's own (the same wherever the ranks held the same). Every rank
  /// must set it alike. Beside a SyncBatchNorm on several ranks, buckets are sent when
  /// backward ends, not during it: ranks that used different parameters would otherwise
  /// cross SyncBatchNorm's sums in backward. Default false (an unused parameter is
  /// reported, naming it; zeros are still sent, so no rank hangs).
  bool findUnusedParameters = false;
  /// Gradients are views into the bucket buffers (no copy per step). Default true.
  bool gradientAsBucketView = true;
  /// Broadcast parameters and buffers from rank 0 at construction. Default true.
  bool broadcastOnConstruction = true;
  /// Plain torch::nn::BatchNorm layers in training mode normalise each rank's own share,
  /// so with unequal shares training is not single-device training on the global batch
  /// (as with PyTorch DDP, where the shares are equal). On several ranks construction
  /// warns once (on rank 0), naming them and hddp::SyncBatchNorm /
  /// convertSyncBatchNorm, unless this says per-rank statistics are intended. Default
  /// false (warn).
  bool allowLocalBatchNorm = false;
  /// Allocate each bucket's buffer when its first gradient arrives instead of at
  /// construction. For ZeRO (hddp/ddp/sharded_optimizer.h), whose ranks keep the
  /// buffers of their own buckets only: set it so that no rank holds a buffer for every
  /// gradient before the owners are known (the Trainer does). Default false.
  bool allocateBucketsLazily = false;
  BufferSync bufferSync = BufferSync::WithGradients;
  /// With BufferSync::WithGradients: every this many synchronized steps. Default 1.
  int bufferSyncInterval = 1;
  /// Fp16/Bf16: commHook = compressedAllreduceHook(at::kHalf / at::kBFloat16);
  /// PowerSgd: commHook = powerSgdHook(powerSgd).
  GradCompression compression = GradCompression::None;
  /// With GradCompression::PowerSgd: the rank, the start step, ... (PyTorch's defaults).
  PowerSgdOptions powerSgd;
  /// What is sent for each bucket (PyTorch's register_comm_hook); empty = an allreduce of
  /// the bucket, or the hook `compression` names. Setting both is a ConfigError.
  CommHook commHook;
  /// Called with a bucket's index (buckets are sent in index order) once the bucket is
  /// ready, just before its communication is launched (before the hook above and before
  /// the launch is timed for lastStepStats()): on the thread that made it ready, the
  /// autograd engine's during backward, the caller's in finalize(). It may block, e.g.
  /// the Trainer's emulated slower card sleeps there the extra time its backward would
  /// have taken (hddp/balance/emulation.h); it must not throw. Empty (the default):
  /// nothing is called, at no cost.
  std::function<void(int bucket)> beforeBucketLaunch;
};

/// What the last synchronized step did (for metrics, benchmarks and tests).
struct DdpStepStats {
  int buckets = 0;
  /// Buckets whose allreduce was launched while backward was still running.
  int bucketsLaunchedDuringBackward = 0;
  /// Seconds from the first bucket's launch to the last bucket's completion.
  double communicationSeconds = 0;
  /// Seconds the end of backward spent waiting for communication (not hidden).
  double waitSeconds = 0;
  /// Parameters that received no gradient (zeros were sent for them).
  int unusedParameters = 0;
};

/// One bucket's allreduce in a step, launch to completion (for timelines).
struct BucketTiming {
  std::chrono::steady_clock::time_point launched;
  std::chrono::steady_clock::time_point completed;
  int64_t bytes = 0;
};

namespace detail {
template <typename T, typename = void>
struct IsModuleHolder : std::false_type {};
template <typename T>
struct IsModuleHolder<T, std::void_t<decltype(std::declval<const T&>().ptr())>> : std::true_type {};
template <typename T>
struct IsSharedPtr : std::false_type {};
template <typename T>
struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};
template <typename T>
struct AlwaysFalse : std::false_type {};

/// The module DistributedDataParallel synchronizes, from what a LibTorch program holds:
/// a shared_ptr or a holder is shared; a module object is referenced (shared when a
/// shared_ptr already owns it, else not owned: the caller keeps it alive).
template <typename ModuleLike>
std::shared_ptr<torch::nn::Module> moduleOf(ModuleLike&& module) {
  using T = std::remove_cv_t<std::remove_reference_t<ModuleLike>>;
  if constexpr (IsSharedPtr<T>::value) {
    static_assert(std::is_base_of<torch::nn::Module, typename T::element_type>::value,
                  "hddp::DistributedDataParallel: the shared_ptr must point to a "
                  "torch::nn::Module (or a class derived from it)");
    return std::static_pointer_cast<torch::nn::Module>(std::forward<ModuleLike>(module));
  } else if constexpr (IsModuleHolder<T>::value) {
    return std::static_pointer_cast<torch::nn::Module>(module.ptr());
  } else if constexpr (std::is_base_of<torch::nn::Module, T>::value) {
    if constexpr (!std::is_lvalue_reference<ModuleLike>::value ||
                  std::is_const<std::remove_reference_t<ModuleLike>>::value) {
      static_assert(AlwaysFalse<T>::value,
                    "hddp::DistributedDataParallel: pass the module object itself (a non-const "
                    "lvalue, `Net model; DistributedDataParallel ddp(model, comm);`). DDP "
                    "references it without owning it, so a temporary would be gone at once; "
                    "to hand over ownership pass std::make_shared<Net>() instead");
      return nullptr;
    } else {
      if (std::shared_ptr<torch::nn::Module> owner = module.weak_from_this().lock()) {
        return owner;  // already owned by a shared_ptr (`*ptr`): share it
      }
      // A shared_ptr that owns nothing (the aliasing constructor with an empty owner).
      return std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module>(),
                                                static_cast<torch::nn::Module*>(&module));
    }
  } else {
    static_assert(AlwaysFalse<T>::value,
                  "hddp::DistributedDataParallel takes the model as LibTorch programs hold it: "
                  "a module object (`struct Net : torch::nn::Module {...}; Net model;`, "
                  "referenced: it must outlive the DDP), a std::shared_ptr to a module "
                  "(`std::make_shared<Net>()`), or a module holder (torch::nn::Linear, a "
                  "TORCH_MODULE(Net) type). Pass one of these as the first argument");
    return nullptr;
  }
}
}  // namespace detail

/// Thread safety: one thread drives it (setBatch, forward, backward, finalize,
/// syncBuffers); the autograd engine's threads run its hooks during that thread's
/// backward. Not for concurrent use from several threads. It keeps a reference to the
/// communicator, which must outlive it.

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, Communicator& communicator,
                          DdpOptions options = {});
  /// The model as a LibTorch program holds it: a module object (`Net model;`, referenced,
  /// not owned: keep it alive while the DDP is), a std::shared_ptr to a module, or a
  /// module holder (torch::nn::Linear, a TORCH_MODULE type). Anything else does not
  /// compile, with a message saying what to pass.
  template <typename ModuleLike>
  DistributedDataParallel(ModuleLike&& module, Communicator& communicator, DdpOptions options = {})
      : DistributedDataParallel(detail::moduleOf(std::forward<ModuleLike>(module)), communicator,
                                std::move(options)) {}
  ~DistributedDataParallel();

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// This rank's samples in the coming backward and the global batch of the optimizer
  /// step (all ranks, all accumulated micro-steps). Gradients are scaled by local/global.
  /// Also marks the start of a new step for finalize().
  void setBatch(int64_t localBatch, int64_t globalBatch);

  /// RAII scope in which backward accumulates gradients without communicating.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSyncGuard noSync() { return NoSyncGuard(*this); }

  /// Completes the step's gradient synchronization. Called automatically at the end of
  /// a synchronized backward; call it yourself when this rank ran no backward in the
  /// step (b_i = 0): it then contributes zero gradients. A no-op when the step is
  /// already synchronized, i.e. when no setBatch() and no gradient came since the last
  /// synchronized step ended: so a rank without samples calls setBatch(0, B) in every
  /// step before finalize().
  void finalize();

  /// Sets the buffers to their sample-weighted mean over ranks now: each rank weighs
  /// its values by the local/global shares it set since the last synchronisation, so a
  /// rank that trained on nothing (whose running statistics never moved) sets nothing
  /// and a tiny share sets only its part. (PyTorch broadcasts rank 0's buffers, which is
  /// wrong when rank 0 had no samples.) BatchNorm's running mean then equals that of
  /// single-device training on the whole batch; the running variance is the weighted
  /// mean of the ranks' variances. Integer buffers (num_batches_tracked) are rounded.
  /// Without setBatch() every rank weighs the same; where all weights are 0, rank 0's
  /// values are kept everywhere. One allreduce (float64) per call; blocks.
  /// (BufferSync::BeforeForward: call it before each forward.)
  void syncBuffers();

  torch::nn::Module& module();
  /// The module; a pointer that does not own it when DDP was given a module object that
  /// no shared_ptr owns.
  const std::shared_ptr<torch::nn::Module>& modulePtr() const;
  Communicator& communicator();
  const DdpOptions& options() const;

  /// The parameter names of each bucket, in bucket order (for inspection and tests).
  std::vector<std::vector<std::string>> bucketLayout() const;
  const DdpStepStats& lastStepStats() const;
  /// With GradCompression::PowerSgd: the hook's state (to save and load it, to read its
  /// step); null otherwise.
  const std::shared_ptr<PowerSgdState>& powerSgdState() const;
  /// Replaces what is sent for the gradients, before the first step (the Trainer resolves
  /// GradCompression::Auto through it, once DDP has checked that the ranks' models
  /// agree). Every rank must make the same call. ConfigError once a step has begun, when
  /// DdpOptions::commHook is set, or for Auto.
  void setCompression(GradCompression compression, const PowerSgdOptions& powerSgd = {});

  /// The parameters DDP synchronizes, in its order: those that require a gradient, a
  /// tied tensor once (under its first name). ZeRO's shards are ranges of this list.
  std::vector<at::Tensor> parameters() const;
  std::vector<std::string> parameterNames() const;

  /// ZeRO (hddp/ddp/sharded_optimizer.h sets it; rarely called directly): `owners[i]` is
  /// the rank that steps parameters()[i]. Buckets are rebuilt so that none mixes owners,
  /// and each is reduced (summed) to its owner instead of allreduced: after backward only
  /// the owner holds a parameter's summed gradient. The other ranks' gradients of it
  /// are zeros (`releaseForeign` false: ZeRO stage 1, the buffers stay allocated) or
  /// undefined (true: stage 2, a foreign bucket's buffer is freed once its reduction
  /// completed; one is in flight while the next fills during backward). Every rank makes the same
  /// call, before the first step. ConfigError with a comm hook or compression.
  void setGradientOwners(std::vector<int> owners, bool releaseForeign);

  // ---- A step given up, and the buckets' order: what a loop of its own needs to recover
  // from running out of memory and to resume with the buckets it saved (the Trainer uses
  // exactly these; docs/ddp.md, "A step given up, and the bucket order").

  /// For a rank that cannot finish its forward or backward in this step (it ran out of
  /// memory): sends zeros for the gradients it has not sent and marks the step as
  /// abandoned, so that the step's collectives complete on every rank. Call it after the
  /// failed forward or backward, instead of finalize(). Returns false when it came too
  /// late (every bucket was already sent): it then finishes the step as the end of
  /// backward would have, and the step stands, with the same sums on every rank.
  bool abandonStep();
  /// True on every rank when some rank abandoned the last synchronized step: its
  /// gradients are then incomplete and the optimizer step must be skipped on every rank.
  /// The status travels in the last bucket's allreduce (one extra element), so reading it
  /// costs no collective; it waits for the device. An abandoned step does not count in
  /// DDP's step count (which paces DdpOptions::bufferSyncInterval), and its buffers do
  /// not weigh in the next synchronisation.
  bool lastStepAbandoned();
  /// The caller put the buffers back as they were before the last synchronized step's
  /// forward (a step that every rank skips, e.g. on the GradScaler's overflow): their
  /// weight in the next synchronisation goes back too. The step still counts (as
  /// PyTorch's iteration does).
  void putBackStepBuffers();
  /// Each bucket's allreduce in the last synchronized step, in launch order.
  const std::vector<BucketTiming>& lastStepBucketTimes() const;
  /// The parameters in bucket order (bucketLayout() flattened): what a checkpoint keeps so
  /// that a resumed run has the buckets of the run it continues (PowerSGD's memories were
  /// made in them).
  std::vector<std::string> bucketOrder() const;
  /// Builds the buckets from `names` (a bucketOrder() of the same model) and keeps them:
  /// no rebuild after the first step. Call it on every rank with the same names (as read
  /// from one checkpoint: it is no collective, and ranks with different buckets would send
  /// different collectives), between steps, best before the first. False, and nothing
  /// changed, when the names are not exactly the model's parameters (each once);
  /// ConfigError in the middle of a step.
  bool setBucketOrder(const std::vector<std::string>& names);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hddp
