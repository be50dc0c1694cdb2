// A part of the training loop: a class that the Trainer calls at each phase of fit(),
// with a name and, when it has one, a state of its own that the Trainer's state files
// keep. A program adds its own parts (a callback: early stopping, a gradient-norm log,
// an EMA of the weights) with Trainer::addPart, without touching hddp:
//
//   class StopWhenGood final : public hddp::TrainerPart {
//    public:
//     std::string name() const override { return "stop_when_good"; }
//     void onEpochEnd(const hddp::EpochSummary& e, hddp::LoopRequests& r) override {
//       if (e.trainLoss < 0.05) r.stop("the training loss is below 0.05");
//     }
//   };
//   trainer.addPart(std::make_shared<StopWhenGood>());
//
// The phases of one fit(), on every rank (docs/architecture.md draws them):
//
//   onFitStart                 after the resume, before the first step
//   per step:  beforeStep      after the schedule, before the forward
//              afterBackward   the gradients are reduced (and weighted); not for a step
//                              abandoned after running out of memory (it is repeated)
//              afterOptimizerStep   the parameters are updated (or the GradScaler
//                              skipped the update on every rank)
//   onEpochEnd                 after the epoch's evaluation, before its state file
//   onFitEnd                   with the run's summary
//
// The contract (the reasons are in docs/architecture.md, "Agreed decisions"):
// - Every rank adds the same parts, by name, in the same order: fit() checks it (one
//   allgather at its start, before it resumes) and fails every rank with a ConfigError
//   naming the first difference otherwise.
// - Every hook is called on every rank at the same point of the loop, so a hook may run
//   collectives of its own, the same ones on every rank; such a hook agrees its own
//   failures before its collectives (hddp/comm/exchange.h: agreeOutcome), since a rank
//   that throws first would not meet the others there. saveState() and loadState() run
//   no collective (rank 0 alone saves; every rank loads). A step given up after running
//   out of memory is trained again: its schedule and beforeStep run again for it.
// - What a hook asks of the loop (stop the run, save now) and a hook's exception are made
//   every rank's at the next agreement: after each step when some part's
//   agreesEachStep() is true (one 32-byte allreduce a step), else at the end of each
//   epoch and of the fit (no collective a step: a step's requests act at the epoch's
//   end). A hook's exception goes on until then, and then every rank throws, of the
//   same kind (the rank that met it rethrows its own). The Trainer is then where the
//   failure found it, its step counted and its epoch's bookkeeping not: go on from the
//   last state file with a new Trainer rather than save() this one.
// - Hooks run on the training thread, one at a time, in the order the parts were added.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace hddp {

class Communicator;

/// What the schedule hook and the parts see before each step.
struct StepInfo {
  int64_t step = 0;  // global step index, 0-based (continues across epochs and resumes)
  int64_t epoch = 0;
  int64_t stepInEpoch = 0;
  int64_t stepsPerEpoch = 0;  // at the current plan (the last step may be partial)
  int64_t localBatch = 0;
  int64_t globalBatch = 0;
  /// Steps the run is planned to have in all: epochs x steps per epoch, capped by
  /// maxSteps and, once measured, by the time budget.
  int64_t totalSteps = 0;
};

struct TrainSummary {
  int64_t steps = 0;       // steps run by this fit() call
  int64_t totalSteps = 0;  // including those before a resume
  int64_t epochsCompleted = 0;
  double seconds = 0;
  double samplesPerSecond = 0;  // global samples / s over this fit()
  double lastTrainLoss = 0;     // the last epoch's mean loss over all ranks' samples
  int64_t repeatedSteps = 0;    // steps abandoned and repeated after running out of memory
  /// This rank's peak memory over the fit: the allocator's peak allocated bytes on a
  /// device (or the emulated device), the process's resident set on the CPU.
  double peakMemoryBytes = 0;
  std::map<std::string, double> lastEvaluation;
  std::string lastStateFile;
};

/// Where fit() starts.
struct FitStart {
  int64_t step = 0;   // steps done before this fit() (a resume's)
  int64_t epoch = 0;  // the epoch it starts in
  bool resumed = false;
};

/// One step as it ended.
struct StepEnd {
  StepInfo info;        // as beforeStep saw it: info.step is the step's 0-based index
  double loss = 0;      // this rank's mean loss over its share (0 when it had no samples)
  bool stepped = true;  // false: the GradScaler skipped the update (an fp16 overflow)
};

/// One epoch as it ended.
struct EpochSummary {
  int64_t epoch = 0;                         // 0-based
  int64_t steps = 0;                         // in this epoch (over resumes)
  int64_t step = 0;                          // steps done in all
  double trainLoss = 0;                      // the epoch's mean over every rank's samples
  std::map<std::string, double> evaluation;  // the evaluation's (empty: none this time)
};

/// What a part asks of the loop. A request made on any rank holds on every rank, from
/// the next agreement (see the contract above).
class LoopRequests {
 public:
  /// End the run at the next agreement (after this step with agreesEachStep(), else at
  /// the epoch's end), as maxSteps would: what was trained is evaluated and, with a save
  /// folder, saved; Trainer::stoppedEarly() is true when epochs were left. `why` goes to
  /// the log of the rank that asked.
  void stop(std::string why) {
    stop_ = true;
    why_ = std::move(why);
  }
  /// Save (commit) the state at the next agreement, as saveEvery would (at an epoch's
  /// end its state file is written anyway). Needs TrainerOptions::saveDir: without one,
  /// fit() fails with a ConfigError on every rank.
  void save() { save_ = true; }

  bool stopAsked() const { return stop_; }
  bool saveAsked() const { return save_; }
  const std::string& why() const { return why_; }

 private:
  bool stop_ = false;
  bool save_ = false;
  std::string why_;
};

class TrainerPart {
 public:
  virtual ~TrainerPart() = default;
  /// Unique among the Trainer's parts: letters, digits, '_' and '-' (at most 64). It
  /// names the part's state in state files, so keep it across versions of the program.
  virtual std::string name() const = 0;

  /// `comm` is the Trainer's communicator (for a part's own collectives); it outlives
  /// the fit.
  virtual void onFitStart(Communicator& comm, const FitStart& start) {
    (void)comm;
    (void)start;
  }
  virtual void beforeStep(const StepInfo& info) { (void)info; }
  virtual void afterBackward(const StepInfo& info) { (void)info; }
  virtual void afterOptimizerStep(const StepEnd& step, LoopRequests& requests) {
    (void)step;
    (void)requests;
  }
  virtual void onEpochEnd(const EpochSummary& epoch, LoopRequests& requests) {
    (void)epoch;
    (void)requests;
  }
  virtual void onFitEnd(const TrainSummary& summary) { (void)summary; }
  /// True: the requests and failures of this part's step hooks are agreed after each step
  /// (a stop or save acts at that step; one allreduce a step, which makes each step wait
  /// for the slowest rank once more). False (the default): at the end of each epoch.
  virtual bool agreesEachStep() const { return false; }

  // ---- the part's state (kept in the Trainer's state files) ------------------------------
  // A part with stateVersion() > 0 is saved with the Trainer (rank 0's bytes, in every
  // copy of a commit; a saveState() that throws fails the save on every rank) and loaded
  // on every rank.
  // A file without the part's entry (written before the part existed) leaves the part as
  // it is and says so in the log; a file with a part this program does not have loads,
  // and the log names the part whose state goes unused. A file whose version of the part
  // is newer than stateVersion() is refused with a StateError before anything changes.

  /// The format version of saveState()'s bytes; 0 (the default): no state.
  virtual int stateVersion() const { return 0; }
  virtual std::string saveState() const { return {}; }
  /// Takes back what saveState() returned, written at `version` (1..stateVersion()).
  /// Throw (an hddp::StateError, say) to refuse bytes, leaving the part as it was: the
  /// load then fails on every rank, and the Trainer's parts loaded before it are put back.
  virtual void loadState(const std::string& bytes, int version) {
    (void)bytes;
    (void)version;
  }
};

}  // namespace hddp
