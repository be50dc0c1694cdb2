#include "hddp/data/plan_sampler.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <utility>

#include "hddp/balance/planner.h"
#include "hddp/core/error.h"

namespace hddp {

// What every copy of one PlanSampler shares.
struct PlanSampler::Shared {
  Shared(int64_t datasetSize, int rankIn, SamplerOptions samplerOptions)
      : rank(rankIn), options(withMinimum(samplerOptions)), sampler(datasetSize, options) {}

  static SamplerOptions withMinimum(SamplerOptions o) {
    o.minLocalBatch = std::max<int64_t>(1, o.minLocalBatch);  // never an empty batch
    return o;
  }

  // The plan for the step asked for now, every share raised to the minimum. Callers
  // hold `mutex`.
  BatchPlan currentPlan() const {
    BatchPlan p = planner ? planner->plan() : plan;
    const auto ranks = static_cast<int64_t>(p.local.size());
    HDDP_CHECK_AS(ConfigError, rank >= 0 && rank < ranks, "PlanSampler: rank ", rank,
                  " is not in the plan ", p.describe(), " (", ranks,
                  " ranks); give the sampler this rank's number in the job");
    HDDP_CHECK_AS(ConfigError, p.global >= ranks * options.minLocalBatch,
                  "PlanSampler: a global batch of ", p.global, " cannot give each of ", ranks,
                  " ranks ", options.minLocalBatch,
                  " sample(s), and torch's data loader cannot hand out an empty batch; "
                  "make the global batch at least ",
                  ranks * options.minLocalBatch);
    const bool short_ = std::any_of(p.local.begin(), p.local.end(),
                                    [this](int64_t b) { return b < options.minLocalBatch; });
    return short_ ? scalePlan(p, p.global, options.minLocalBatch) : p;
  }

  // Starts the pass reset() starts. Callers hold `mutex`.
  void startPass() {
    pending.clear();
    if (resumeFrom) {
      sampler.restore(*resumeFrom);
      resumeFrom.reset();
    } else {
      sampler.setEpoch(nextEpoch);
    }
    nextEpoch = sampler.epoch() + 1;
    consumed = sampler.state();
    lastGlobal = 0;
    started = true;
  }

  mutable std::mutex mutex;
  const int rank;
  const SamplerOptions options;
  const BatchPlanner* planner = nullptr;
  BatchPlan plan;
  DistributedSampler sampler;
  int64_t nextEpoch = 0;
  std::optional<DistributedSampler::State> resumeFrom;
  bool started = false;
  // Steps the loader asked for and has not handed out yet, with the position after each.
  std::deque<std::pair<StepShare, DistributedSampler::State>> pending;
  DistributedSampler::State consumed;
  // The global batch of the step stepOfBatch() last returned (0: none in this pass).
  int64_t lastGlobal = 0;
};

PlanSampler::PlanSampler(int64_t datasetSize, const BatchPlanner& planner, int rank,
                         SamplerOptions options)
    : shared_(std::make_shared<Shared>(datasetSize, rank, options)) {
  shared_->planner = &planner;
  shared_->currentPlan();  // a rank outside the plan is an error now, not at the first batch
}

PlanSampler::PlanSampler(int64_t datasetSize, BatchPlan plan, int rank, SamplerOptions options)
    : shared_(std::make_shared<Shared>(datasetSize, rank, options)) {
  shared_->plan = std::move(plan);
  shared_->currentPlan();
}

void PlanSampler::setPlan(const BatchPlan& plan) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const BatchPlan before = shared_->plan;
  const BatchPlanner* planner = shared_->planner;
  shared_->plan = plan;
  shared_->planner = nullptr;
  try {
    shared_->currentPlan();
  } catch (...) {
    shared_->plan = before;
    shared_->planner = planner;
    throw;
  }
}

void PlanSampler::setEpoch(int64_t epoch) {
  HDDP_CHECK(epoch >= 0, "PlanSampler::setEpoch: epoch must be >= 0, got ", epoch);
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->nextEpoch = epoch;
  shared_->lastGlobal = 0;  // a step of the pass before is not repeated into this one
  // PyTorch's habit, load() and then setEpoch(epoch) at the top of each epoch, resumes
  // the loaded epoch where it stood; another epoch starts afresh.
  if (shared_->resumeFrom && shared_->resumeFrom->epoch != epoch) {
    shared_->resumeFrom.reset();
  }
}

StepShare PlanSampler::stepOfBatch() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  HDDP_CHECK_AS(ConfigError, !shared_->pending.empty(),
                "PlanSampler::stepOfBatch: no batch is pending. Call it once for each batch "
                "the loader hands out, inside the loop, on the sampler the loader was made "
                "from (or a copy of it)");
  auto [share, after] = std::move(shared_->pending.front());
  shared_->pending.pop_front();
  shared_->consumed = after;
  shared_->lastGlobal = share.globalBatch;
  return std::move(share);
}

void PlanSampler::repeatLastStep() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  HDDP_CHECK_AS(ConfigError, shared_->lastGlobal > 0,
                "PlanSampler::repeatLastStep: no step was handed out in this pass; call it "
                "after stepOfBatch() returned the step to repeat");
  HDDP_CHECK_AS(ConfigError, shared_->pending.empty(), "PlanSampler::repeatLastStep: the loader ",
                "asked for ", shared_->pending.size(),
                " step(s) ahead, which cannot be taken back; a loop that repeats steps "
                "(out-of-memory recovery) needs DataLoaderOptions().workers(0)");
  DistributedSampler::State back = shared_->consumed;
  back.position -= shared_->lastGlobal;
  HDDP_INTERNAL_ASSERT(back.position >= 0, "PlanSampler: a repeat before the epoch's start");
  shared_->sampler.restore(back);
  shared_->consumed = back;
  shared_->lastGlobal = 0;
}

int64_t PlanSampler::epoch() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->sampler.epoch();
}

DistributedSampler::State PlanSampler::state() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->consumed;
}

void PlanSampler::reset(std::optional<size_t> newSize) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (newSize && static_cast<int64_t>(*newSize) != shared_->sampler.size()) {
    shared_->sampler = DistributedSampler(static_cast<int64_t>(*newSize), shared_->options);
  }
  shared_->startPass();
}

std::optional<std::vector<size_t>> PlanSampler::next(size_t /*batchSize*/) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (!shared_->started) {
    shared_->startPass();  // a caller that did not reset() first, unlike torch's loader
  }
  const BatchPlan plan = shared_->currentPlan();
  if (shared_->sampler.epochDone(plan.global)) {
    shared_->lastGlobal = 0;  // the pass ended: a repeat now would be lost at the next
    return std::nullopt;
  }
  StepShare share = shared_->sampler.next(plan, shared_->rank);
  std::vector<size_t> indices(share.indices.begin(), share.indices.end());
  shared_->pending.emplace_back(std::move(share), shared_->sampler.state());
  return indices;
}

void PlanSampler::save(torch::serialize::OutputArchive& archive) const {
  const DistributedSampler::State s = state();
  archive.write("plan_sampler", at::tensor(std::vector<int64_t>{s.epoch, s.position}, at::kLong));
}

void PlanSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor t;
  HDDP_CHECK_AS(StateError, archive.try_read("plan_sampler", t) && t.numel() == 2,
                "PlanSampler::load: the archive holds no PlanSampler position (was it written "
                "by PlanSampler::save?)");
  t = t.to(at::kLong).contiguous();
  const DistributedSampler::State s{t.data_ptr<int64_t>()[0], t.data_ptr<int64_t>()[1]};
  std::lock_guard<std::mutex> lock(shared_->mutex);
  HDDP_CHECK_AS(StateError,
                s.epoch >= 0 && s.position >= 0 && s.position <= shared_->sampler.size(),
                "PlanSampler::load: position ", s.position, " of epoch ", s.epoch,
                " does not fit a dataset of ", shared_->sampler.size(),
                " samples (was it saved for another dataset?)");
  shared_->resumeFrom = s;
  shared_->consumed = s;
  shared_->lastGlobal = 0;
}

}  // namespace hddp
