// ZeRO stages 1 and 2 in C++ (Rajbhandari et al., SC'20), with shards of unequal size:
// each rank keeps the optimizer state (stage 1), and the summed gradients (stage 2),
// of a contiguous range of the model's parameters only, sized by a weight per rank
// (by default its free device memory, so a laptop card beside a large card holds a
// small shard). The batch shares stay the planner's: what a rank computes and what it
// stores are separate.
//
//   hddp::DistributedDataParallel ddp(model, comm);
//   torch::optim::Adam adam(hddp::uniqueParameters(*model), torch::optim::AdamOptions(1e-3));
//   hddp::ShardedOptimizerOptions zero;
//   zero.stage = 2;
//   zero.weights = hddp::memoryShardWeights(comm, freeBytesAfterTheModel);
//   hddp::ShardedOptimizer sharded(ddp, adam, zero);   // adam now holds this rank's shard
//   for (...) {
//     ddp.setBatch(b, B);
//     sharded.zeroGrad();
//     loss(model->forward(x), y).backward();   // each bucket reduced to its owner
//     sharded.clipGradNorm(1.0);               // optional: the norm over all shards
//     sharded.step();                          // steps this rank's shard, gathers the model
//   }
//
// How it works:
// - The shard of rank r is a contiguous range of DistributedDataParallel::parameters()
//   (whole tensors: an optimizer needs a tensor whole), holding close to weights[r] /
//   sum(weights) of all elements. A rank may own nothing.
// - The wrapped optimizer's parameter groups are cut down to this rank's shard, so it
//   creates state only for it; its options (learning rate, ...) stay the user's to set,
//   and state files keep them as optimizer.save() does (saveShard / loadShards).
// - DDP reduces each gradient bucket to the bucket's owner (Communicator::reduce):
//   after backward the owner holds the gradient of the whole global batch, weighted as
//   always (b_i / B), and the other ranks hold zeros (stage 1) or nothing (stage 2:
//   their buffer of a foreign bucket is freed once its reduction completed).
// - step() steps the shard, then each owner broadcasts its updated parameters in
//   chunks of `gatherChunkBytes`, so every rank holds the whole model for the next
//   forward. An all-gather of unequal parts is what this is; Gloo's and NCCL's
//   all-gathers take equal parts, and padding every part to the largest would cost the
//   large card's shard on every rank. Bytes on the wire per step: the gradients once
//   (reduce) plus the parameters once (broadcast), as an allreduce.
// - Only optimizers whose update is per element: SGD (with or without momentum), Adam,
//   AdamW. Others (LBFGS, a user's own) are refused with a ConfigError.
// - With hddp::GradScaler: scaler.unscale(sharded.optimizer()) checks this rank's shard,
//   and the found-inf is agreed across ranks before any shard steps; then
//   `if (scaler.step(sharded.optimizer())) sharded.gatherParameters();`.
//
// Exactness: the parameters after k steps equal single-device training on the whole
// global batch (a per-element update of a subset is the same update), whatever the
// batch shares and the shard sizes (tests/ddp/sharded_optimizer_test.cpp, float64).
//
// Thread safety: as DistributedDataParallel: one training thread. It keeps references
// to the DDP and the optimizer, which must outlive it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch {
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace hddp {

class Communicator;
class DistributedDataParallel;

/// Which rank owns which parameters (indices into DistributedDataParallel::parameters()).
struct ShardLayout {
  /// The owning rank of each parameter.
  std::vector<int> owner;
  /// Rank r owns parameters [begin[r], end[r]) (begin == end: nothing).
  std::vector<int> begin;
  std::vector<int> end;
  /// Rank r's elements.
  std::vector<int64_t> elements;

  int ranks() const { return static_cast<int>(begin.size()); }
  /// "rank 0: 3 tensors, 1.2 M elements (8.3%); rank 1: ...".
  std::string describe() const;
};

/// Splits parameters of `numels` elements (in order) into contiguous ranges, one per
/// weight, rank r's holding close to weights[r] / sum(weights) of all elements: a
/// parameter goes to the rank whose part of the element line holds its midpoint, so a
/// range is off by at most half a tensor at each end. Weights must be finite, >= 0, and
/// not all 0 (ConfigError otherwise); a rank of weight 0 owns nothing.
ShardLayout shardLayout(const std::vector<int64_t>& numels, const std::vector<double>& weights);

/// How shards are sized, as the trainers' --shard-by takes it.
struct ShardBy {
  enum class Kind {
    /// In proportion to each rank's free device memory after the model. Default.
    Memory,
    /// Equal parts (PyTorch's ZeroRedundancyOptimizer, DeepSpeed).
    Equal,
    /// Given ratios, one per rank ("1:3").
    Ratios,
  };
  Kind kind = Kind::Memory;
  std::vector<double> ratios;
};
/// "memory", "equal" or ratios "R0:R1:..." (numbers >= 0, not all 0); ConfigError
/// naming the text otherwise.
ShardBy parseShardBy(const std::string& text);
std::string describeShardBy(const ShardBy& by);

/// Every rank's `freeBytes` (its free device memory after the model), gathered: the
/// memory weights of ShardBy::Memory. Blocking; every rank calls it. ConfigError when a
/// value is not finite or every rank reports none.
std::vector<double> memoryShardWeights(Communicator& communicator, double freeBytes);

struct ShardedOptimizerOptions {
  /// 1: the optimizer state is sharded; every rank keeps buffers for all gradients.
  /// 2: the gradients too (foreign buffers freed once sent). Default 2.
  int stage = 2;
  /// One weight per rank, the same on every rank; empty (the default): equal shards.
  std::vector<double> weights;
  /// Parameters gathered per broadcast after each step. Default 25 MiB, DDP's bucket.
  int64_t gatherChunkBytes = 25 << 20;
};

/// Bytes of per-parameter state `optimizer` holds now (SGD's momentum, Adam's and
/// AdamW's moments); -1 for an optimizer of another kind.
int64_t optimizerStateBytes(const torch::optim::Optimizer& optimizer);

/// Thread safety: see the top of this file.
class ShardedOptimizer {
 public:
  /// Cuts `optimizer` down to this rank's shard and sets DDP's gradient owners. Call
  /// before any backward, on every rank, with the same options: the ranks compare their
  /// stage, owners and gather chunk (one allgather) and all throw a ConfigError when
  /// they differ. The optimizer must hold only parameters DDP synchronizes (ConfigError
  /// otherwise).
  ShardedOptimizer(DistributedDataParallel& ddp, torch::optim::Optimizer& optimizer,
                   ShardedOptimizerOptions options = {});
  ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  /// Steps this rank's shard, then gathers the updated parameters on every rank.
  void step();
  /// Each owner broadcasts its parameters (step() calls it; call it yourself after a
  /// GradScaler::step(optimizer()) that returned true).
  void gatherParameters();
  /// Scales every shard's gradients so that their global 2-norm is at most `maxNorm`
  /// (torch::nn::utils::clip_grad_norm_ over the whole model: coefficient maxNorm /
  /// (norm + 1e-6), applied when below 1). Returns the norm before clipping, the same on
  /// every rank. One allreduce of one number.
  double clipGradNorm(double maxNorm);
  /// Clears every parameter's gradient (set to none), shard or not.
  void zeroGrad();

  /// The wrapped optimizer, holding this rank's shard: for its options (learning rate),
  /// the GradScaler and schedules.
  torch::optim::Optimizer& optimizer();
  const ShardLayout& layout() const;
  int stage() const;
  /// Bytes of optimizer state this rank holds now.
  int64_t stateBytes() const;

  /// This rank's optimizer state, keyed by parameter name (and index) with each
  /// parameter's size, and what optimizer.save() keeps beside it: every parameter
  /// group's options (learning rate, momentum, betas, eps, weight decay, nesterov,
  /// amsgrad) and the group of each parameter of the shard. One part of a state file.
  /// Host bytes.
  std::vector<uint8_t> saveShard() const;
  /// Takes this rank's parameters' state out of every part saved by saveShard() (by any
  /// number of ranks with any layout: N parts into this layout), and sets every group's
  /// options to the saved ones, as optimizer.load() does (on every rank, a rank without
  /// a shard included). A parameter that no part holds starts without state. StateError,
  /// with the optimizer left as it was, on a part that does not fit the model or was
  /// saved with other parameter groups (another number of groups, or a parameter in
  /// another group). Parts written before groups were kept load with the program's
  /// options, and a warning says so.
  void loadShards(const std::vector<std::vector<uint8_t>>& parts);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hddp
