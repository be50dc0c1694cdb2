// ShardedOptimizer's implementation (internal to the ddp layer): the class behind
// hddp/ddp/sharded_optimizer.h. Its bodies live in files named for what they hold:
// sharded_optimizer.cpp (construction, the step's gather, clipping, the public API's
// forwarding), sharded_optimizer_state.cpp (saveShard / loadShards) and
// sharded_optimizer_layout.cpp (ShardLayout, ShardBy and the memory weights).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "hddp/ddp/sharded_optimizer.h"

namespace hddp {

namespace zero {

/// The optimizers whose update is per element, so that a shard steps alone.
enum class OptimizerKind { Sgd, Adam, AdamW };

/// ConfigError for any other optimizer.
OptimizerKind kindOf(torch::optim::Optimizer& optimizer);
const char* kindName(OptimizerKind kind);
int64_t bytesOf(const at::Tensor& t);
/// Bytes of a per-parameter state's tensors (SGD's momentum, Adam's moments).
int64_t stateTensorBytes(const torch::optim::OptimizerParamState& state);

}  // namespace zero

/// Thread safety: see hddp/ddp/sharded_optimizer.h.
class ShardedOptimizer::Impl {
 public:
  Impl(DistributedDataParallel& ddp, torch::optim::Optimizer& optimizer,
       ShardedOptimizerOptions options);

  void checkRanksAgree();
  void gatherParameters();
  double clipGradNorm(double maxNorm);
  void zeroGrad();
  int64_t stateBytes() const;

  // ---- the state file's part (sharded_optimizer_state.cpp) ---------------------------
  std::vector<uint8_t> saveShard() const;
  void loadShards(const std::vector<std::vector<uint8_t>>& parts);
  /// Checks the parameter groups the parts recorded against this optimizer's (their
  /// number, and each parameter's group by name) and returns the saved options of each
  /// group; empty for parts saved before they recorded groups. StateError on a mismatch.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> savedGroups(
      std::vector<torch::serialize::InputArchive>& archives) const;

  DistributedDataParallel& ddp_;
  Communicator& comm_;
  torch::optim::Optimizer& optimizer_;
  ShardedOptimizerOptions options_;
  zero::OptimizerKind kind_ = zero::OptimizerKind::Sgd;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, int> byName_;
  /// The optimizer's parameter group of each parameter as the user built it (before the
  /// cut to this shard); -1: in none (DDP synchronizes it, this optimizer does not step it).
  std::vector<int> groupOf_;
  ShardLayout layout_;
};

}  // namespace hddp
