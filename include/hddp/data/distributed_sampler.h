// A distributed sampler that serves each step's global batch split by the current plan.
//
// Each epoch is a seeded permutation of the dataset's N indices, identical on all
// ranks. Step k takes the next `plan.global` indices of it and gives rank r the slice
// starting at plan.offsetOf(r). Whatever the plan, and also when it changes in the
// middle of an epoch, every sample is used exactly once per epoch across all ranks.
// Last partial batch: with dropLast the epoch ends when fewer than plan.global indices
// remain (they are not used this epoch); otherwise the last step takes them all, the
// plan rescaled to that size (scalePlan). With minLocalBatch (SyncBatchNorm, or any
// model whose forward needs every rank), every rank gets at least that many samples in
// every step: when what would be left for the last step cannot give every rank its
// minimum (fewer than ranks x minLocalBatch samples), the step before takes it too, so
// that step is larger than plan.global (its StepShare::globalBatch says by how much;
// DDP weights by it, so the gradient is still the exact mean). Nothing is dropped. The
// state (epoch, position) can be saved and restored to resume in the middle of an epoch.
#pragma once

#include <cstdint>
#include <vector>

#include "hddp/balance/batch_plan.h"

namespace torch {
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace hddp {

struct SamplerOptions {
  uint64_t seed = 0;
  /// Shuffle each epoch. Default true.
  bool shuffle = true;
  /// Drop the last partial batch of an epoch. Default false (keep it, rescaled).
  bool dropLast = false;
  /// Every rank gets at least this many samples in every step (see above). Default 0:
  /// a rank may get none (it then calls DistributedDataParallel::finalize()).
  int64_t minLocalBatch = 0;
};

/// What one rank trains on in one step.
struct StepShare {
  std::vector<int64_t> indices;  // this rank's samples
  int64_t localBatch = 0;
  int64_t globalBatch = 0;  // all ranks' samples this step (pass to DDP setBatch)
  BatchPlan plan;           // the plan actually used (rescaled for a partial batch)
};

class DistributedSampler {
 public:
  DistributedSampler(int64_t datasetSize, SamplerOptions options = {});

  /// Starts `epoch` (its permutation) from its beginning.
  void setEpoch(int64_t epoch);
  /// True when the epoch has no step left for a plan of `globalBatch` samples.
  bool epochDone(int64_t globalBatch) const;
  /// The next step's share of `rank` under `plan`; every rank must call it with the
  /// same plan. Throws when the epoch is done.
  StepShare next(const BatchPlan& plan, int rank);

  struct State {
    int64_t epoch = 0;
    int64_t position = 0;
    /// As "sampler" in `archive` (the Trainer's state files).
    void save(torch::serialize::OutputArchive& archive) const;
    /// hddp::StateError when `archive` has no sampler state.
    static State load(torch::serialize::InputArchive& archive);
  };
  State state() const { return {epoch_, position_}; }
  void restore(const State& state);

  int64_t size() const { return size_; }
  int64_t epoch() const { return epoch_; }
  /// Indices remaining in this epoch.
  int64_t remaining() const { return size_ - position_; }
  /// Samples the next step under `plan` takes (its StepShare::globalBatch).
  int64_t nextStepSize(const BatchPlan& plan) const;

 private:
  int64_t size_;
  SamplerOptions options_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
  std::vector<int64_t> permutation_;
};

}  // namespace hddp
