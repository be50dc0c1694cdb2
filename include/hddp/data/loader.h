// The prefetching loader: worker threads read, decode, augment and collate the next
// batches while the current one trains.
//
//   hddp::PrefetchLoader loader(dataset, rank, options);      // owns the sampler
//   loader.startEpoch(epoch, planner.plan());
//   while (auto batch = loader.next()) {                      // nullopt: epoch done
//     ... train on batch->input / batch->target (already on options.device) ...
//     if (planner.endStep()) loader.setPlan(planner.plan());
//   }
//
// Order: batch k of an epoch holds exactly the samples the DistributedSampler assigns
// to this rank for step k; each sample's augmentation RNG is seeded from (seed, epoch,
// index). The batches are therefore the same for any number of workers.
// Plans: batches are prepared under the current plan; setPlan() with a different plan
// discards the prepared ones and rewinds the sampler to the first unconsumed step, so
// nothing is skipped or used twice.
// Errors: an exception in a worker is raised by next() on the training thread, as an
// hddp::DataError naming the sample index, epoch and step, in the order the batches
// would have been consumed.
// CUDA: batches are collated into pinned memory; a side stream copies batch k+1 to the
// device while batch k trains, with an event the compute stream waits on and
// recordStream so the caching allocator does not reuse the memory early. All of it is
// written with c10's device-generic stream/event interfaces.
// Stopping: the destructor (or stop()) joins the workers, also mid-epoch.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <optional>

#include "hddp/data/dataset.h"
#include "hddp/data/distributed_sampler.h"

namespace c10 {
class Event;
}  // namespace c10

namespace hddp {

struct LoaderOptions {
  /// Worker threads; 0 = load in the training thread inside next(). Default 2.
  int workers = 2;
  /// Batches prepared ahead of the one training (the queue's bound). Default 2.
  int depth = 2;
  /// Seed of the augmentation RNGs (the shuffle seed is the sampler's). Default 0.
  uint64_t seed = 0;
  /// Where batches go. CUDA: pinned host memory and an asynchronous side-stream copy.
  c10::Device device = c10::Device(c10::kCPU);
  /// Page-locked host batches when the device is CUDA. Default true.
  bool pinMemory = true;
  SamplerOptions sampler;
};

struct Batch {
  at::Tensor input;  // [localBatch, ...] on the device; undefined when localBatch == 0
  at::Tensor target;
  StepShare share;  // indices, local and global batch, the plan used
  int64_t epoch = 0;
  int64_t stepInEpoch = 0;
  /// Bytes of input + target moved to the device (or collated, on CPU).
  int64_t bytes = 0;
  /// Seconds next() blocked waiting for this batch (~0 when prefetch keeps up).
  double waitSeconds = 0;
  /// Recorded on the copy stream before and after the host-to-device copy (on a
  /// device only), timing enabled: the step timer reads the copy's duration from them.
  std::shared_ptr<c10::Event> copyStarted;
  std::shared_ptr<c10::Event> copied;
};

/// Thread safety: one consumer thread calls next(), startEpoch(), resume(), setPlan()
/// and state(); the loader's own worker threads build batches (Dataset::get must be
/// safe to call from several threads at once). stop() (or destruction) joins the
/// workers. Ownership: shares the dataset.
class PrefetchLoader {
 public:
  PrefetchLoader(std::shared_ptr<const Dataset> dataset, int rank, LoaderOptions options = {});
  ~PrefetchLoader();
  PrefetchLoader(const PrefetchLoader&) = delete;
  PrefetchLoader& operator=(const PrefetchLoader&) = delete;

  /// Starts `epoch` from its beginning under `plan` (discards anything prepared).
  void startEpoch(int64_t epoch, const BatchPlan& plan);
  /// Continues from a saved sampler state (resume) under `plan`.
  void resume(const DistributedSampler::State& state, const BatchPlan& plan);
  /// Switches to `plan` from the next unconsumed step; a no-op when it is the same.
  void setPlan(const BatchPlan& plan);
  /// The next batch of the epoch, or nullopt when the epoch is done.
  std::optional<Batch> next();
  /// Sampler position after the last batch next() returned (what a state file saves).
  DistributedSampler::State state() const;
  /// Joins the workers; next() afterwards throws.
  void stop();

  const Dataset& dataset() const;
  const LoaderOptions& options() const;
  /// Batches (global steps) left in the current epoch under the current plan.
  int64_t stepsLeftInEpoch() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hddp
