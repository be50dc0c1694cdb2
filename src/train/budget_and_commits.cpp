// The time budget and the commits: what the Trainer's ranks agree on between steps (the
// step at which the time budget ends the run, and the commits of an elastic job,
// elastic.h).
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "hddp/core/logging.h"
#include "train/trainer_impl.h"

namespace hddp {

void Trainer::Impl::updateTimeBudget() {
  constexpr int64_t kEvery = 10;
  const int64_t done = step_ - fitStartStep_;
  if (done < kEvery || done % kEvery != 0) {
    return;
  }
  // The slowest rank's clock decides, and every rank derives the same step from the
  // same allreduced numbers.
  // The job's budget: training seconds and steps since it started, earlier generations
  // of a restarted job included, so the end and the schedule are an undisturbed run's.
  const double elapsed = budgetSecondsBefore_ + seconds(fitStart_, Clock::now());
  at::Tensor t =
      at::tensor({elapsed, elapsed - evaluationSeconds_}, at::kDouble).to(comm_.device());
  comm_.allreduce(t, {ReduceOp::Max}).wait();
  comm_.synchronize();  // the host reads it next (Communicator::synchronize)
  t = t.cpu();
  const double elapsedMax = t[0].item<double>();
  const double perStep =
      t[1].item<double>() / static_cast<double>(std::max<int64_t>(1, step_ - budgetStartStep_));
  const double left = options_.timeBudgetSeconds - elapsedMax;
  const int64_t more = perStep > 0 && left > 0 ? static_cast<int64_t>(left / perStep) : 0;
  const bool first = budgetSteps_ == 0;
  // At least one more step: the schedule call of the step about to run is the first to
  // see the new total, so the run must not end before it (its total would be stale).
  budgetSteps_ = std::max<int64_t>(step_ + 1, step_ + more);
  if (first) {
    HDDP_LOG_SHARED("train", comm_.rank(), "time budget ", options_.timeBudgetSeconds,
                    " s: ", perStep * 1e3, " ms per step after ", done, " steps, so ",
                    plannedSteps(), " steps in all (re-measured every ", kEvery, " steps)");
  }
}

void Trainer::Impl::commit(TrainSummary& summary) {
  summary.lastStateFile = saveMidEpoch();
  lastSaved_ = step_;
  agreeAtCommit(summary);
}

void Trainer::Impl::agreeAtCommit(const TrainSummary& summary) {
  const auto t0 = lastSaveStart_;
  if (!elastic_.enabled) {
    return;
  }
  jobRecord_.add("commit", {{"step", step_}, {"file", summary.lastStateFile}});
  // Agree on a re-form request (the launcher signals the ranks one by one) and on the
  // next commit: the slowest commit against the slowest rank's wall time per step.
  const double commitSeconds = seconds(t0, Clock::now());
  const double stepSeconds = seconds(lastCommitTime_, t0) /
                             static_cast<double>(std::max<int64_t>(1, step_ - lastCommitStep_));
  const bool reform = train::reformRequested() || train::reformFileExists(elastic_.dir);
  at::Tensor t =
      at::tensor({reform ? 1.0 : 0.0, commitSeconds, stepSeconds}, at::kDouble).to(comm_.device());
  comm_.allreduce(t, {ReduceOp::Max}).wait();
  comm_.synchronize();  // the host reads it next (Communicator::synchronize)
  t = t.cpu();
  const int64_t every = train::commitInterval(t[1].item<double>(), t[2].item<double>());
  if (every != commitEvery_) {
    HDDP_LOG_DEBUG("train", "commits every ", every, " steps (a commit takes ",
                   t[1].item<double>() * 1e3, " ms, a step ", t[2].item<double>() * 1e3, " ms)");
  }
  commitEvery_ = every;
  nextCommit_ = step_ + commitEvery_;
  lastCommitTime_ = Clock::now();
  lastCommitStep_ = step_;
  if (t[0].item<double>() > 0) {
    HDDP_LOG_SHARED("train", comm_.rank(), "elastic: committed step ", step_, " to ",
                    summary.lastStateFile, "; leaving for the group to re-form (exit code ",
                    train::kReformExitCode, ")");
    std::fflush(nullptr);                // log lines and metrics are written through at once
    std::_Exit(train::kReformExitCode);  // loader threads may be mid-batch: no unwinding
  }
}

}  // namespace hddp
