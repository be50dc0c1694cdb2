// The time budget and the commits: what the Trainer's ranks agree on between steps (the
// step at which the time budget ends the run; a commit's elastic part is
// train::ElasticRun's, elastic.h).
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/trainer_impl.h"

namespace hddp {

void Trainer::Impl::updateTimeBudget() {
  constexpr int64_t kEvery = 10;
  const int64_t done = step_ - run_.startStep;
  if (done < kEvery || done % kEvery != 0) {
    return;
  }
  // The slowest rank's clock decides, and every rank derives the same step from the
  // same allreduced numbers.
  // The job's budget: training seconds and steps since it started, earlier generations
  // of a restarted job included, so the end and the schedule are an undisturbed run's.
  const double now = budgetNow();
  const double start = budget_.start.value_or(now);
  const double elapsed = budget_.secondsBefore + (now - start);
  // A clock that went back (TrainerOptions::budgetClock) is reported with the numbers,
  // so that every rank fails together instead of one leaving the others in a collective.
  const double wentBack = now < start || !std::isfinite(now) ? 1.0 : 0.0;
  const auto t = reduceValues(
      comm_, std::array<double, 3>{elapsed, elapsed - budget_.evaluationSeconds, wentBack},
      ReduceOp::Max);
  HDDP_CHECK_AS(ConfigError, t[2] == 0,
                "the time budget's clock went back or is not finite on a rank (here: ", start,
                " s at the start, ", now,
                " s now): TrainerOptions::budgetClock must return seconds that never decrease");
  const double elapsedMax = t[0];
  const double perStep =
      t[1] / static_cast<double>(std::max<int64_t>(1, step_ - budget_.startStep));
  const double left = options_.timeBudgetSeconds - elapsedMax;
  const int64_t more = perStep > 0 && left > 0 ? static_cast<int64_t>(left / perStep) : 0;
  const bool first = budget_.endStep == 0;
  // At least one more step: the schedule call of the step about to run is the first to
  // see the new total, so the run must not end before it (its total would be stale);
  // but not into a next epoch: at an epoch's end the run ends with the epoch.
  const int64_t atLeast = loader_->stepsLeftInEpoch() == 0 ? step_ : step_ + 1;
  budget_.endStep = std::max<int64_t>(atLeast, step_ + more);
  if (first) {
    HDDP_LOG_SHARED("train", comm_.rank(), "time budget ", options_.timeBudgetSeconds,
                    " s: ", perStep * 1e3, " ms per step after ", done, " steps, so ",
                    plannedSteps(), " steps in all (re-measured every ", kEvery, " steps)");
  }
}

double Trainer::Impl::budgetNow() const {
  if (options_.budgetClock) {
    return options_.budgetClock();
  }
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

double Trainer::Impl::budgetSeconds() const {
  return budget_.secondsBefore + (budget_.start ? budgetNow() - *budget_.start : 0.0);
}

void Trainer::Impl::commit(TrainSummary& summary) {
  summary.lastStateFile = saveMidEpoch();
  run_.lastSaved = step_;
  elastic_.committed(comm_, step_, summary.lastStateFile, run_.lastSaveStart);
}

}  // namespace hddp
