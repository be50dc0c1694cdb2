// A LibTorch sampler that serves this rank's unequal share of each step, for a program
// that keeps its torch::data datasets, transforms and make_data_loader loop.
//
//   hddp::PlanSampler sampler(dataset.size().value(), planner, ctx.rank());
//   auto loader = torch::data::make_data_loader(
//       std::move(dataset).map(torch::data::transforms::Stack<>()), sampler,
//       torch::data::DataLoaderOptions().batch_size(B).workers(2));  // batch_size: ignored
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {   // each pass starts an epoch
//     for (auto& batch : *loader) {
//       const hddp::StepShare step = sampler.stepOfBatch();  // this batch's step
//       ddp.setBatch(step.localBatch, step.globalBatch);
//       ... forward, backward, optimizer step ...
//       planner.record(step.localBatch, computeSeconds);
//       planner.endStep();  // a new plan applies to the steps the loader asks for next
//     }
//   }
//
// Every step is hddp::DistributedSampler's (distributed_sampler.h): each epoch a seeded
// permutation of the dataset, identical on every rank; step k takes the next global
// batch of it and gives each rank its slice under the plan in force when the loader
// asks for that step, so every sample is used exactly once per epoch across the ranks,
// whatever the plan and also when it changes within an epoch. The plan comes from a
// BatchPlanner (read at each request) or is given (setPlan()).
//
// What torch's loader needs, and what that asks of the program:
// - The loader asks for batches ahead (max_jobs, by default 2 x workers) and hands them
//   out in the order asked (DataLoaderOptions::enforce_ordering, the default). A new
//   plan therefore applies from the next step asked for, on every rank alike, provided
//   every rank uses the same workers and max_jobs. stepOfBatch() gives the step of the
//   batch just handed out (its local and global batch for DDP), in that order.
// - The loader cannot hand out an empty batch: every rank gets at least
//   SamplerOptions::minLocalBatch samples (at least 1) in every step; a plan that gives a
//   rank fewer is raised to that, taking from the largest shares (the same on every
//   rank: the global batch stays the plan's). Give the planner the same minimum
//   (PlannerSettings::minLocalBatch) so that it plans what runs.
// - DataLoaderOptions::batch_size is ignored (the plan sets the sizes); keep its
//   drop_last false (it would compare the plan's shares with batch_size) and use
//   SamplerOptions::dropLast instead.
// - Each pass over the loader (its begin()) calls reset(), which starts the next epoch
//   (the first pass: epoch 0), or the epoch setEpoch() named, or the position load()
//   restored (also after a setEpoch() of the epoch loaded).
//
// Copies share one state: make_data_loader takes the sampler by value, and the object
// the program keeps still sets the plan and reads the steps of the loader's copy (a
// std::move into make_data_loader copies too, so the program's object keeps working).
// Thread safety: calls are serialised by a mutex (the loader calls next() and reset()
// from the thread that iterates it). Ownership: a planner passed in is referenced and
// must outlive every copy. Header cost: this includes torch/data/samplers/base.h.
#pragma once

#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/data/distributed_sampler.h"

namespace hddp {

class BatchPlanner;

class PlanSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  /// Follows `planner`: each step's plan is planner.plan() when the loader asks for it.
  PlanSampler(int64_t datasetSize, const BatchPlanner& planner, int rank,
              SamplerOptions options = {});
  /// A plan of your own (e.g. equalSplit(worldSize, B)); setPlan() changes it.
  PlanSampler(int64_t datasetSize, BatchPlan plan, int rank, SamplerOptions options = {});
  /// Copies share the state; so do "moves", which copy (the moved-from sampler still works).
  PlanSampler(const PlanSampler&) = default;
  PlanSampler& operator=(const PlanSampler&) = default;
  ~PlanSampler() override = default;

  /// The plan for the steps asked for from now on (replaces the planner, if any). Every
  /// rank makes the same call at the same step.
  void setPlan(const BatchPlan& plan);
  /// The next reset() (the loader's next pass) starts `epoch`. After load(), the epoch
  /// loaded keeps its position (PyTorch's habit: load, then setEpoch(epoch) at the top
  /// of each epoch resumes where the save stood); another epoch drops the position and
  /// starts from its beginning.
  void setEpoch(int64_t epoch);

  /// The step of the next batch the loader hands out: call it once per batch, in the
  /// loop. Its localBatch is the batch's size, its globalBatch what DDP's setBatch() takes
  /// (the plan's, or a partial last step's). ConfigError when no batch is pending.
  StepShare stepOfBatch();
  /// Serves the step stepOfBatch() last returned again: the next step the loader asks
  /// for is that step's global batch, split by the plan in force then (after a re-plan:
  /// an out-of-memory recovery, hddp/train/out_of_memory.h). Every rank calls it at the
  /// same step. Needs a loader that has not asked ahead (DataLoaderOptions().workers(0):
  /// torch's loader with workers asks for 2 x workers steps ahead, which cannot be taken
  /// back); hddp::ConfigError otherwise, and when no step was handed out in this pass
  /// since the last load() or setEpoch(), or the pass has ended.
  void repeatLastStep();
  /// The epoch of the current pass.
  int64_t epoch() const;
  /// Where the epoch stands after the last step stepOfBatch() returned (steps the loader
  /// asked for ahead do not count): what save() writes.
  DistributedSampler::State state() const;

  // torch::data::samplers::Sampler.
  /// Starts the next epoch (see above); `newSize`: the dataset now has that many samples.
  void reset(std::optional<size_t> newSize = std::nullopt) override;
  /// This rank's indices of the next step; nullopt when the epoch is done.
  /// `batchSize` (DataLoaderOptions::batch_size) is ignored.
  std::optional<std::vector<size_t>> next(size_t batchSize) override;
  /// The position of state() (as "plan_sampler"); load() makes the next reset() continue
  /// from it, so a program resumes in the middle of an epoch.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace hddp
