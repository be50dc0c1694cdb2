// PowerSGD: low-rank gradient compression with error feedback (Vogels et al., NeurIPS
// 2019), as a DDP communication hook, with the semantics and defaults of PyTorch's
// `powerSGD_hook` (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py).
//
//   auto state = std::make_shared<hddp::PowerSgdState>(hddp::PowerSgdOptions{/*rank=*/2});
//   hddp::DdpOptions options;
//   options.commHook = hddp::powerSgdHook(state);
//
// Per bucket: each gradient of two or more dimensions (viewed as rows x the rest) is
// sent as two factors P (rows x r) and Q (cols x r) when (rows + cols) x r x
// minCompressionRate < rows x cols; every other gradient (biases, small matrices) is
// sent whole, all of them in one allreduce. Before `startStep` synchronized steps every
// bucket is a plain allreduce.
//
// What hddp does differently from the Python hook, and why:
// - No division by the world size: DDP hands the hook gradients already weighted by
//   each rank's share (b_r / B), so sums are the gradient of the global batch, with
//   unequal shares and ranks without samples alike.
// - The error-feedback memory is kept in those weighted units: after a step rank r keeps
//   (its input) - (the reduced result) / n. With equal shares that is PyTorch's memory
//   divided by n, and the steps agree with PyTorch's to float rounding; with any shares
//   the memories sum to the whole compression error, so a change of plan biases nothing.
// - A step whose reduced gradient is not finite in any bucket (a float16 overflow the
//   GradScaler will skip) leaves every bucket's error and Q memories as they were before
//   it; PyTorch's memory would hold inf/NaN from then on. A step abandoned after an
//   out-of-memory error is undone whole by discardStep(), its count included.
// - P and Q travel in the gradients' type by default, as PyTorch's; `wireType` may cast
//   them to another for the allreduces (float16 or bfloat16 halve the bytes); they are
//   computed and kept in the gradients' type.
// - The memories are kept per parameter (by its name in the model), not per bucket:
//   DDP's buckets may be laid out anew (after the first step of a resumed run, whose
//   state is already compressing) without a memory landing on another parameter.
// - PyTorch's `batch_tensors_with_same_shape` is not offered (the same result, batched).
//
// The GradScaler's scale is not known to the hook: the error memory is in scaled units,
// as PyTorch's. After the scale changes, the memory is off by the same factor for a
// step or two (the scaler changes it rarely: on an overflow, or every 2000 steps).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hddp/ddp/comm_hooks.h"

namespace hddp {

struct PowerSgdOptions {
  /// The rank r of the factors (matrix_approximation_rank): 1 to 4 is typical; higher
  /// is closer to the exact gradient and sends more.
  int rank = 1;
  /// Synchronized steps sent as a plain allreduce before compression starts
  /// (start_powerSGD_iter; PyTorch's advice: about 10% of the run). At least 2 with error
  /// feedback or warm start (DDP's buckets are rebuilt after the first step).
  int64_t startStep = 1000;
  /// A gradient is compressed only where it sends this many times fewer elements.
  double minCompressionRate = 2.0;
  bool errorFeedback = true;
  /// Reuse the last step's Q as the next step's starting point (one power iteration
  /// per step that accumulates across steps).
  bool warmStart = true;
  /// Added to each column's norm in the orthogonalisation; 0 (PyTorch's default)
  /// unless a gradient may be all zeros.
  double orthogonalizationEpsilon = 0.0;
  /// The seed of the random starting Q; the same on every rank.
  uint64_t randomSeed = 0;
  /// P and Q on the wire: c10::ScalarType::Undefined (the default) sends them in the
  /// gradients' own type, as computed; at::kFloat, at::kDouble, at::kHalf or
  /// at::kBFloat16 casts them to that type for their allreduces.
  c10::ScalarType wireType = c10::ScalarType::Undefined;
};

/// The hook's state: options, the step count, and per parameter the error memory and
/// the Q memory. Shared by the hook (which owns a reference) and the caller, which may
/// save and load it. Used from DDP's backward and its end; not thread-safe otherwise.
class PowerSgdState {
 public:
  /// ConfigError for an option out of range (rank < 1, startStep <= 1 with error
  /// feedback or warm start, a wire type other than Undefined, Float, Double, Half,
  /// BFloat16).
  explicit PowerSgdState(PowerSgdOptions options = {});

  const PowerSgdOptions& options() const { return options_; }
  /// Synchronized steps seen (PyTorch's `iter`).
  int64_t step() const { return step_; }
  /// Compression has started (step() >= startStep).
  bool compressing() const { return step_ >= options_.startStep; }
  /// Gradient elements before and after compression, summed over the compressed steps.
  int64_t elementsBefore() const { return elementsBefore_; }
  int64_t elementsAfter() const { return elementsAfter_; }

  /// The state for a state file: "step", "draws", "error/<parameter>", "q/<parameter>"
  /// (CPU copies; <parameter> is GradBucket::names' entry, or "<bucket>.<position>" for
  /// a bucket without names). The error memories are this rank's own.
  std::vector<std::pair<std::string, at::Tensor>> stateDict() const;
  /// Loads what stateDict() wrote. A memory whose size no longer fits its parameter
  /// (another model) is dropped with a log line when the parameter is next seen. The
  /// per-bucket memories of an earlier hddp ("error.<bucket>", "q.<bucket>") are dropped
  /// with a log line (compression goes on from fresh memories). Error for a key it does
  /// not know.
  void loadStateDict(const std::vector<std::pair<std::string, at::Tensor>>& state);
  /// Drops the error and Q memories (the step count stays), logging `why`: for a new
  /// membership whose ranks no longer hold the memories they made.
  void resetMemories(const std::string& why);
  /// Undoes everything the last step did to this state (error and Q memories, the random
  /// draws, the step count), for a step that is not applied: abandoned after some rank ran
  /// out of memory, and repeated. Then the repeat trains as a straight run of its split
  /// would. Call it on every rank after the step's backward ended (DDP's finalize) and
  /// before the next step's backward; a second call, or one before any step or right
  /// after loadStateDict(), does nothing.
  ///
  /// A step whose reduced gradient is not finite in some bucket (a float16 overflow that
  /// the GradScaler skips) is undone by the hook itself at the step's last bucket: no
  /// bucket's memories change, and only the step count goes on (as PyTorch's `iter`).
  void discardStep();

 private:
  friend struct PowerSgdAccess;
  // What the state held before the step in progress (or the last one): the memories'
  // tensors are replaced at a step's end, never written in place, so holding the maps
  // holds their old values.
  struct StepUndo {
    bool open = false;      // a step began since the last discard or load
    bool lastSeen = false;  // its last bucket was handed over: the next one begins a step
    bool finite = true;     // every bucket of the step so far reduced to finite values
    int64_t step = 0;
    int64_t draws = 0;
    std::map<std::string, at::Tensor> error;
    std::map<std::string, at::Tensor> q;
    bool startLogged = false;
  };
  void beginStep();
  void undoMemories();  // error, Q and draws as before the step (not the count)
  StepUndo undo_;
  PowerSgdOptions options_;
  int64_t step_ = 0;
  int64_t draws_ = 0;  // random starting Qs drawn so far (the seed of the next)
  std::map<std::string, at::Tensor> error_;  // by parameter (see stateDict())
  std::map<std::string, at::Tensor> q_;
  int64_t elementsBefore_ = 0;
  int64_t elementsAfter_ = 0;
  bool startLogged_ = false;
};

/// The PowerSGD hook over a state the caller keeps (to save it, or to read its step).
CommHook powerSgdHook(std::shared_ptr<PowerSgdState> state);
/// The PowerSGD hook with a state of its own.
CommHook powerSgdHook(PowerSgdOptions options = {});

/// Seconds the hook's own arithmetic takes on `device` for gradients of `shapes` (one per
/// parameter) under `options` (rank, minimum compression rate): for each gradient it
/// compresses, error feedback in, P = M Q, the orthogonalisation, Q = M^T P and the error
/// left by P Q^T, on random data in float32; the fastest of three after a warm-up. What
/// `--compress auto` prices PowerSGD's compute with (hddp/balance/compression_model.h).
double timePowerSgdCompute(const std::vector<std::vector<int64_t>>& shapes,
                           const PowerSgdOptions& options, const c10::Device& device);

}  // namespace hddp
