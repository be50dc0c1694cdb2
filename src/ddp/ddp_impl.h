// DistributedDataParallel's implementation (internal to the ddp layer): the class
// behind the public API. Its bodies live in files named for what they hold:
// ddp_construction.cpp (construction, the model checks, hook removal),
// ddp_hooks.cpp (the gradient hooks, buckets filling up and their launch),
// ddp_step_end.cpp (the end of a synchronized backward, an abandoned step, the
// buffers, the bucket layout and its rebuild from the observed order), and
// distributed_data_parallel.cpp (the public API's forwarding).
#pragma once

#include <torch/nn/module.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hddp/ddp/distributed_data_parallel.h"

namespace hddp {
namespace ddp {

using Clock = std::chrono::steady_clock;

inline double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace ddp

/// Thread safety: used by the thread that runs forward and calls backward, and by the
/// autograd engine's threads during that backward (hooks, the final callback), never
/// concurrently with the caller's own calls.
class DistributedDataParallel::Impl {
 public:
  struct Param {
    at::Tensor tensor;
    std::string name;
    int bucket = -1;
    int64_t offset = 0;  // elements into the bucket's flat buffer
    bool ready = false;
    // .grad holds the sum over ranks of the last synchronized step, not yet cleared
    // by the user: the next step sends it divided by the world size (see holdOver).
    bool holdsReduced = false;
    // A gradient reached it on this rank since the last synchronized step, noSync()
    // micro-steps included (PyTorch's local_used_map; read with findUnusedParameters).
    bool used = false;
    unsigned preHookIndex = 0;
  };

  // findUnusedParameters: what .grad held before the step's end, for a parameter that no
  // gradient reached on this rank, in case none reached it on any rank either.
  struct PriorGrad {
    bool kept = false;
    at::Tensor tensor;  // the .grad tensor itself (undefined: there was none)
    at::Tensor value;   // a copy of its values
  };

  struct Bucket {
    std::vector<int> params;
    at::Tensor flat;       // undefined while a released foreign bucket (ZeRO-2) waits for gradients
    int64_t elements = 0;  // the gradients' elements (the flat may hold the status too)
    int owner = -1;        // with gradient owners: the rank the bucket is reduced to
    std::function<void()> finish;  // the comm hook's, run after `work` completed
    CommHookThen then;             // the comm hook's second round, if any
    int pending = 0;
    bool launched = false;
    Work work;
    ddp::Clock::time_point launchedAt;
    // Written by the backend's completion callback, which may run after wait()
    // returned (c10's Future wakes waiters before running callbacks): shared ownership.
    std::shared_ptr<std::atomic<int64_t>> completedAtNs;
  };

  // ---- construction (ddp_construction.cpp) ------------------------------------------

  /// Checks the options and the model (one device, the same on every rank), broadcasts
  /// rank 0's parameters and buffers, builds the buckets and registers the hooks.
  Impl(std::shared_ptr<torch::nn::Module> module, Communicator& comm, DdpOptions options);
  /// Removes the hooks, giving back the post-accumulate hooks it wrapped.
  ~Impl();

  enum class Naming {
    /// Parameters and frozen parameters by their names (the device check).
    Bare,
    /// Every tensor, buffers included, as "param <name>", "frozen <name>", "buffer
    /// <name>" (the model signature).
    WithKinds,
  };
  std::vector<std::pair<std::string, at::Tensor>> named(Naming naming) const;
  /// The parameter names of each bucket, in bucket order.
  std::vector<std::vector<std::string>> layout() const;

  // ---- hooks and buckets (ddp_hooks.cpp) --------------------------------------------

  void setBatch(int64_t local, int64_t global);
  void setNoSync(bool on) { noSync_ = on; }
  bool noSync() const { return noSync_; }
  void registerHooks();
  /// hook_ (and powerSgd_, hookSumsWholeBuffer_) from options_.commHook / compression.
  void installHook();
  /// At construction: the warning of DdpOptions::allowLocalBatchNorm.
  void warnOfLocalBatchNorm() const;
  /// Weights each incoming gradient by b_i / B before it is accumulated, and marks the
  /// parameter ready after accumulation.
  void registerHook(int i);
  /// PyTorch's semantics for a gradient the user did not clear between two synchronized
  /// steps: .grad holds the last sum over ranks, so it is sent divided by the world size.
  void holdOver(Param& p);
  /// A sparse gradient is made dense when it enters its bucket (a tensor hook may not
  /// change a gradient's layout).
  void densify(const Param& p, at::Tensor& grad);
  void onGradientReady(int index);
  void beginStep();
  /// The parameter's slice of its bucket: shares the bucket's storage without being an
  /// autograd view (LibTorch's zero_grad() detach_()es gradients, which views refuse).
  at::Tensor sliceOf(const Param& p);
  void markReady(int index, bool duringBackward);
  /// Launches the ready buckets strictly in index order, so every rank issues the same
  /// collectives in the same order.
  void launchReadyBuckets(bool duringBackward);

  // ---- the step's end (ddp_step_end.cpp) --------------------------------------------

  /// The end of a synchronized backward (queued on the autograd engine).
  void finalize();
  void finalizeStep();  // finalize() but for its out-of-memory error after the collectives
  /// This rank could not finish the step (out of memory): zeros for every gradient not
  /// yet sent and a 1 in the status slot; false when every bucket was already sent.
  bool abandonStep();
  bool lastStepAbandoned();
  bool discountIfAbandoned(bool abandoned);
  void putBackStepBuffers();
  /// The last element of the last bucket (launched last): 0 from every rank that
  /// finished the step, 1 from a rank that abandoned it; summed by the allreduce.
  at::Tensor statusSlot();
  /// Buffers become the sample-weighted mean over ranks (DistributedDataParallel::
  /// syncBuffers).
  void syncBuffers();
  void buildBuckets(const std::vector<int>& order);
  /// Allocates a released bucket's buffer again (zeros), at its first gradient.
  void ensureFlat(Bucket& b);
  /// findUnusedParameters, as PyTorch: a parameter that no rank used since the last
  /// synchronized step keeps its .grad as it was (undefined stays undefined, so the
  /// optimizer skips it). keepPriorGradient remembers it before the parameter is marked
  /// ready; launchUsedMap sums every rank's used flags (one allreduce of one int per
  /// parameter, after the last bucket); unusedEverywhere waits for it (empty: the option
  /// is off); restoreUnusedEverywhere puts the remembered gradients back.
  void keepPriorGradient(size_t index);
  void launchUsedMap();
  std::vector<bool> unusedEverywhere();
  void restoreUnusedEverywhere(const std::vector<bool>& unused);

  // ---- gradient owners (ZeRO; ddp_owners.cpp) -----------------------------------------

  bool sharded() const { return !owners_.empty(); }
  bool foreign(const Bucket& b) const { return sharded() && b.owner != comm_.rank(); }
  void setGradientOwners(std::vector<int> owners, bool releaseForeign);
  /// Splits buckets so that none mixes owners (keeping the order within each).
  std::vector<std::vector<int>> splitByOwner(const std::vector<std::vector<int>>& buckets) const;
  /// During backward (ZeRO-2): waits for the oldest foreign buckets in flight beyond
  /// kForeignInFlight and releases them.
  void releaseSentForeignBuckets(bool keepInFlight);
  /// After the step's reductions: foreign gradients become zeros (ZeRO-1) or undefined
  /// with their buffers freed (ZeRO-2).
  void settleForeignGradients();
  void release(Bucket& b);
  void rebuildFromObservedOrder();
  /// findUnusedParameters beside a SyncBatchNorm that synchronizes over several ranks:
  /// buckets wait for the end of backward (ddp_construction.cpp).
  bool holdBucketsUntilBackwardEnds();

  std::shared_ptr<torch::nn::Module> module_;
  Communicator& comm_;
  DdpOptions options_;
  CommHook hook_;  // what is sent for each bucket
  // hook_ is one of hddp's elementwise sums (allreduce, fp16/bf16), built from
  // DdpOptions::compression: it is handed the whole flat buffer, the status slot
  // included. A user's hook gets the gradients only, and the status is summed by a
  // one-element allreduce of its own (statusWire_), launched right after the last bucket.
  bool hookSumsWholeBuffer_ = false;
  std::shared_ptr<PowerSgdState> powerSgd_;  // GradCompression::PowerSgd's state
  at::Tensor statusWire_;
  Work statusWork_;
  at::Tensor usedMap_;  // findUnusedParameters: the used flags, summed over ranks
  Work usedWork_;
  std::vector<PriorGrad> priorGrads_;
  std::vector<Param> params_;
  std::vector<at::Tensor> frozen_;
  std::vector<std::string> frozenNames_;
  std::vector<at::Tensor> buffers_;
  std::vector<std::string> bufferNames_;
  std::vector<Bucket> buckets_;
  double weight_ = 1.0;
  double bufferWeight_ = 0.0;      // sum of local/global since the buffers were last synced
  double weightAfterStep_ = 0.0;   // bufferWeight_ when the last step ended
  double weightBeforeStep_ = 0.0;  // ... when the one before it ended (undone with a step)
  bool batchSet_ = false;          // setBatch() was called since then
  bool noSync_ = false;
  bool stepActive_ = false;
  bool stepDone_ = false;  // the last step was synchronized; no new one has started
  bool warnedSparse_ = false;
  bool abandoning_ = false;
  bool abandonedLocally_ = false;
  // finalize() ran out of memory after the step's collectives ended (until the next step).
  bool collectivesEnded_ = false;
  int nextBucket_ = 0;
  size_t readyCount_ = 0;
  int64_t step_ = 0;
  bool stepCounted_ = false;  // finalize() counted the step; lastStepAbandoned() not read yet
  bool recordOrder_ = true;
  bool holdBuckets_ = false;        // this step's buckets are sent at its end only
  bool warnedHoldBuckets_ = false;  // said once in the log
  std::vector<int> readyOrder_;
  DdpStepStats stats_;
  std::vector<BucketTiming> bucketTimes_;  // the last synchronized step's, launch order
  // ZeRO: the owning rank of each parameter (empty: every rank receives every sum).
  std::vector<int> owners_;
  bool releaseForeign_ = false;
  at::Tensor status_;                 // with owners: the step's status, outside the buckets
  std::vector<int> foreignInFlight_;  // ZeRO-2: foreign buckets sent, not yet released
};

}  // namespace hddp
