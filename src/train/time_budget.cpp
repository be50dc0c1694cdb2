// The time budget (hddp/train/time_budget.h): the slowest rank's seconds per training
// step, agreed every kEvery steps, and the step at which the run ends.
#include "hddp/train/time_budget.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

TimeBudget::TimeBudget(Communicator& comm, double seconds, Clock clock)
    : comm_(comm), seconds_(seconds), clock_(std::move(clock)) {
  HDDP_CHECK_AS(ConfigError, std::isfinite(seconds),
                "the time budget must be a finite number of seconds, not ", seconds);
}

double TimeBudget::now() const {
  if (clock_) {
    return clock_();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void TimeBudget::start(int64_t step) {
  secondsBefore_ = 0;
  evaluationSeconds_ = 0;
  startStep_ = step;
  endStep_ = 0;
  firstStep_ = step;
  startClock();
}

void TimeBudget::resume(const Account& saved, int64_t step) {
  HDDP_CHECK_AS(StateError,
                std::isfinite(saved.seconds) && saved.seconds >= 0 &&
                    std::isfinite(saved.evaluationSeconds) && saved.evaluationSeconds >= 0 &&
                    saved.startStep >= 0 && saved.endStep >= 0 && saved.startStep <= step,
                "TimeBudget::resume: the account (", saved.seconds, " s, ", saved.evaluationSeconds,
                " s evaluating, steps ", saved.startStep, " to ", saved.endStep,
                ") is not one a budget of step ", step,
                " saved; resume from another state, or start afresh");
  secondsBefore_ = saved.seconds;
  evaluationSeconds_ = saved.evaluationSeconds;
  startStep_ = saved.startStep;
  endStep_ = saved.endStep;
  firstStep_ = step;
  startClock();
}

void TimeBudget::startClock() { startedAt_ = now(); }

bool TimeBudget::afterStep(int64_t step, bool lastOfEpoch) {
  const int64_t done = step - firstStep_;
  if (!enabled() || done < kEvery || done % kEvery != 0) {
    return false;
  }
  // The slowest rank's clock decides, and every rank derives the same step from the
  // same allreduced numbers. The job's account: training seconds and steps since it
  // started, earlier generations of a restarted job included, so the end and the
  // schedule are an undisturbed run's.
  const double t = now();
  const double start = startedAt_.value_or(t);
  const double elapsed = secondsBefore_ + (t - start);
  // A clock that went back is reported with the numbers, so that every rank fails
  // together instead of one leaving the others in a collective.
  const double wentBack = t < start || !std::isfinite(t) ? 1.0 : 0.0;
  const auto r = reduceValues(
      comm_, std::array<double, 3>{elapsed, elapsed - evaluationSeconds_, wentBack}, ReduceOp::Max);
  HDDP_CHECK_AS(ConfigError, r[2] == 0,
                "the time budget's clock went back or is not finite on a rank (here: ", start,
                " s at the start, ", t,
                " s now): TrainerOptions::budgetClock must return seconds that never decrease");
  const double perStep = r[1] / static_cast<double>(std::max<int64_t>(1, step - startStep_));
  const double left = seconds_ - r[0];
  const int64_t more = perStep > 0 && left > 0 ? static_cast<int64_t>(left / perStep) : 0;
  const bool first = endStep_ == 0;
  // At least one more step: the schedule of the step about to run is the first to see
  // the new end, so the run must not end before it; but not into a next epoch.
  const int64_t atLeast = lastOfEpoch ? step : step + 1;
  endStep_ = std::max<int64_t>(atLeast, step + more);
  if (first) {
    HDDP_LOG_SHARED("train", comm_.rank(), "time budget ", seconds_, " s: ", perStep * 1e3,
                    " ms per step after ", done, " steps, so it ends the run at step ", endStep_,
                    " (re-measured every ", kEvery, " steps)");
  }
  return true;
}

int64_t TimeBudget::capSteps(int64_t planned) const {
  return endStep_ > 0 ? std::min(planned, endStep_) : planned;
}

TimeBudget::Account TimeBudget::account() const {
  Account a;
  a.seconds = secondsBefore_ + (startedAt_ ? now() - *startedAt_ : 0.0);
  a.evaluationSeconds = evaluationSeconds_;
  a.startStep = startStep_;
  a.endStep = endStep_;
  return a;
}

}  // namespace hddp
