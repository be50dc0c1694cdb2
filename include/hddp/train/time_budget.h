// A run's time budget: the step at which a run that may train for so many seconds
// ends, agreed by every rank. The Trainer keeps one (TrainerOptions::timeBudgetSeconds);
// a loop of one's own uses it alike:
//
//   hddp::TimeBudget budget(comm, /*seconds=*/600);
//   budget.start(step);                        // fresh: a new run, or a --resume
//   while (!budget.reached(step)) {
//     ... one step ...; ++step;
//     budget.afterStep(step, /*lastOfEpoch=*/...);  // collective every 10 steps
//   }
//   double t0 = budget.now(); evaluate(); budget.leaveOut(budget.now() - t0);
//
// Every 10 steps the ranks agree (one 24-byte allreduce) on the slowest rank's seconds
// per training step, and the budget ends the run at the last step that fits. Seconds
// spent evaluating are left out (leaveOut). The account (seconds so far, the step the
// budget started at, its end) is the job's: a launcher's restart continues it with
// resume(), so the end and a schedule that reads it (StepInfo::totalSteps) are those of
// an undisturbed run.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

namespace hddp {

class Communicator;

class TimeBudget {
 public:
  /// Seconds from any fixed origin, never decreasing. Empty: the steady clock.
  using Clock = std::function<double()>;
  /// Steps between two measurements (and their allreduce).
  static constexpr int64_t kEvery = 10;

  /// What a state file keeps of the budget.
  struct Account {
    double seconds = 0;            // training seconds so far, evaluations included
    double evaluationSeconds = 0;  // of them, left out (evaluations)
    int64_t startStep = 0;         // the step the budget started at
    int64_t endStep = 0;           // the step at which it ends the run (0: not measured)
  };

  /// `seconds` <= 0: no budget (reached() is false, afterStep() does nothing). A budget
  /// with a clock that goes back or is not finite fails afterStep() with a ConfigError on
  /// every rank.
  TimeBudget(Communicator& comm, double seconds, Clock clock = {});

  /// A fresh account starting at `step` (a new run, or a resume of another run's state),
  /// its clock started now.
  void start(int64_t step);
  /// Continues a saved account (a launcher's restart of the same job) at `step`, its
  /// clock started now: the seconds and the end carry on. hddp::StateError, changing
  /// nothing, for an account no budget saves (seconds negative or not finite, negative
  /// steps, a start after `step`).
  void resume(const Account& saved, int64_t step);
  /// Starts the clock again, the account kept: time before it does not count (the
  /// Trainer calls it once its resume and output files are done).
  void startClock();

  /// After the step that made `step` steps done, on every rank (collective every kEvery
  /// steps after start() or resume(); nothing without a budget). `lastOfEpoch`: it was the epoch's
  /// last step, where the run may end with the epoch; otherwise the new end is at least one step
  /// ahead, so the next step's schedule is the first to see it. Returns true when it measured.
  bool afterStep(int64_t step, bool lastOfEpoch);

  /// The budget's clock (for leaveOut).
  double now() const;
  /// Leaves `seconds` out of the training time (an evaluation's).
  void leaveOut(double seconds) { evaluationSeconds_ += seconds; }

  bool enabled() const { return seconds_ > 0; }
  double seconds() const { return seconds_; }
  /// The step at which the budget ends the run; 0 before its first measurement.
  int64_t endStep() const { return endStep_; }
  /// Whether the run must stop before a step that would make `step + 1` steps done.
  bool reached(int64_t step) const { return endStep_ > 0 && step >= endStep_; }
  /// `planned` capped by the end (StepInfo::totalSteps).
  int64_t capSteps(int64_t planned) const;
  /// The account now: the seconds include this run's so far (0 before start()).
  Account account() const;

 private:
  Communicator& comm_;
  double seconds_;
  Clock clock_;
  std::optional<double> startedAt_;  // now() at start(), resume() or startClock()
  int64_t firstStep_ = 0;            // the step start() or resume() was given
  double secondsBefore_ = 0;
  double evaluationSeconds_ = 0;
  int64_t startStep_ = 0;
  int64_t endStep_ = 0;
};

}  // namespace hddp
