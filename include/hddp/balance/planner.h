// The online batch planner: measured speed in, split of the global batch out.
//
// Each rank records, per step, its compute time (time waiting for communication left
// out, see hddp/core/step_timer.h), the part of it that does not grow with the batch
// (the optimizer step), and the time its input took over its link. Every
// `rebalanceEvery` steps the ranks exchange their estimates (one small allgather) and
// every rank solves the same split from the same numbers, so all derive the identical
// plan without a further round trip.
//
// A rank's estimate (RankEstimator) is the median over its recent steps of the seconds
// per sample of compute and of input transfer, and of the fixed seconds, with the
// standard error of the per-sample median. When the newest steps differ from the older
// ones by more than their errors allow (a card that throttles, a link that drops), the
// older steps are dropped, so an estimate follows a real change within one exchange.
// A new plan is adopted only when its predicted gain exceeds `confidence` standard
// errors of that gain (and `hysteresis` of the step time), and, unless the gain is
// decisive, when the next update proposes the same move again (`confirmations`): the
// split does not wander on noise and moves once, to the right place, after a real
// change. A rank at 0 samples keeps its last cost and is probed now and then.
#pragma once

#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/balance/estimator.h"
#include "hddp/balance/memory_model.h"
#include "hddp/comm/communicator.h"

namespace hddp {

/// How the planner measures and decides; the global batch is given apart from these
/// (TrainerOptions::planner holds only these, its global batch is TrainerOptions'). The
/// defaults are those of a BatchPlanner built alone.
struct PlannerSettings {
  /// Steps between plan updates. Default 10.
  int rebalanceEvery = 10;
  /// Warm start: the first plan update after this many (calibration) steps, then
  /// every rebalanceEvery. Default 0 = after rebalanceEvery steps. The first update at
  /// which every rank has measured adopts the solver's split outright (no hysteresis,
  /// no confidence test): the plan it replaces was a guess, not a measured choice.
  int calibrationSteps = 0;
  /// Most recent steps each rank's estimate is taken from. Default 20.
  int window = 20;
  /// Minimum relative improvement of the predicted step time to adopt a new plan.
  /// Default 0.02.
  double hysteresis = 0.02;
  /// A new plan is adopted only when its predicted gain exceeds this many standard
  /// errors of that gain (from the spread of the ranks' recent steps); one more tells a
  /// real change of speed from noise. Default 3.0 (one-sided 99.9% for normal errors;
  /// the errors are themselves estimated from a few steps); 0 turns the test off.
  double confidence = 3.0;
  /// A move whose predicted gain is below `decisiveGain` of the step time must be
  /// proposed by this many consecutive updates, each moving every rank the same way,
  /// before it is adopted: one window's noise (two ranks sharing cores trade speed
  /// from window to window) does not move the plan. Default 2; 1 turns it off.
  int confirmations = 2;
  /// A move predicted to gain at least this fraction of the step time (a card that
  /// throttles, a rank that got faster) is adopted at the first update that sees it.
  /// Default 0.10.
  double decisiveGain = 0.10;
  /// A rank at 0 samples is probed every this many plan updates: it gets 1 sample (from
  /// the largest share) for one update period, so that it is measured again and can
  /// come back when it would help; the next update then adopts the solver's split
  /// outright. Skipped when its last known cost predicts 1 sample to take more than
  /// twice the step. Default 20 (every 200 steps at rebalanceEvery 10); 0 = never.
  int probeEvery = 20;
  /// Smallest share per rank (1 with SyncBatchNorm, whose layers need a sample on every
  /// rank). Default 0.
  int64_t minLocalBatch = 0;
  /// Memory caps derived from each rank's measured memory (recordMemory(); see
  /// hddp/balance/memory_model.h) keep this fraction of the device's memory free.
  /// Default 0.10. Caps are derived only on ranks that record memory.
  double memoryHeadroom = 0.10;
};

struct PlannerOptions : PlannerSettings {
  explicit PlannerOptions(int64_t globalBatch, const PlannerSettings& settings = {})
      : PlannerSettings(settings), globalBatch(globalBatch) {}
  int64_t globalBatch;
};

/// Thread safety: used by one thread (the training loop); record() and endStep() are
/// collective-free except endStep()'s exchange every `rebalanceEvery` steps, which every
/// rank reaches together. Ownership: keeps a reference to the communicator, which must
/// outlive it.
class BatchPlanner {
 public:
  /// Starts from `initial` costs (topology or calibration), or an equal split when empty.
  BatchPlanner(Communicator& communicator, PlannerOptions options,
               std::vector<RankCost> initial = {});

  const BatchPlan& plan() const { return plan_; }
  /// This rank's share under the current plan.
  int64_t localBatch() const { return plan_.local[static_cast<size_t>(comm_.rank())]; }

  /// Records this rank's compute seconds for a step of `samples` samples.
  void record(int64_t samples, double computeSeconds);
  /// Records what this rank's step measured (compute, its fixed part, input transfer).
  void record(const StepMeasurement& measurement);
  /// Records what this rank's memory did in a step; the cap it implies is exchanged
  /// with the estimates at the next update and bounds the plan from then on.
  void recordMemory(const MemoryObservation& observation);
  /// This rank's memory fit so far (steps == 0: nothing recorded).
  MemoryEstimator::Fit memoryFit() const { return memory_.fit(); }
  /// Ends a step; every rank calls it every step. Every rebalanceEvery steps it
  /// exchanges estimates and may change the plan; returns true when it did.
  bool endStep();

  /// The per-rank costs behind the last plan update (for metrics and hddp-probe).
  const std::vector<RankCost>& costs() const { return costs_; }
  /// Seconds the last endStep() spent exchanging estimates (its allgather); 0 when
  /// that step exchanged nothing.
  double lastExchangeSeconds() const { return lastExchangeSeconds_; }

  /// Caps `rank`'s share at `maxSamples` (memory: learned from an allocation failure,
  /// or given), replacing its earlier cap (also a higher one), and re-plans at once,
  /// without hysteresis, from the last estimates (an equal cost per sample before any),
  /// unless the plan is measured and already within every cap. Every rank must make the
  /// same calls. Throws
  /// hddp::ConfigError when the caps can no longer hold the global batch. Returns
  /// true when the plan changed.
  bool setMemoryCap(int rank, int64_t maxSamples);
  /// Each rank's memory cap (std::numeric_limits<int64_t>::max() = none): the lower of
  /// the cap given or learned from an out-of-memory error and the cap derived from its
  /// measured memory.
  std::vector<int64_t> memoryCaps() const;
  /// The caps derived from measured memory at the last update (max() = none).
  const std::vector<int64_t>& derivedMemoryCaps() const { return derivedCaps_; }
  int64_t step() const { return step_; }

  /// Everything needed to resume the planner at the same step (the Trainer's state
  /// file). `window` is this rank's own measurements; the rest is identical on all ranks.
  struct State {
    BatchPlan plan;
    int64_t step = 0;
    std::vector<RankEstimator::Sample> window;
    std::vector<RankCost> costs;
  };
  State state() const;
  /// Restores a state saved at the same world size and global batch; throws
  /// hddp::ConfigError naming what differs.
  void restore(const State& state);
  /// Writes the state every rank shares (plan, step, estimates, memory caps) into
  /// `shared` and this rank's own measurement window into `own`: what the Trainer's
  /// state files keep of the planner.
  void save(torch::serialize::OutputArchive& shared, torch::serialize::OutputArchive& own) const;
  /// Reads what save() wrote at this world size; hddp::StateError when an entry is
  /// missing or malformed, or holds a plan, costs or caps for another number of ranks.
  /// Checks everything it reads before it changes anything.
  void load(torch::serialize::InputArchive& shared, torch::serialize::InputArchive& own);
  /// Reads what save() wrote with other ranks (an elastic job re-formed): rank r takes
  /// the estimates and memory cap of saved rank fromSaved[r] (-1: a newcomer, which
  /// starts at the mean per-sample cost of the others until it is measured); `own`
  /// is this rank's saved window (null: none). The plan is solved afresh from those
  /// costs. Every rank makes the same call. hddp::StateError, before anything changes,
  /// when an entry is missing or malformed (the window too, as load() checks it).
  void loadRemapped(torch::serialize::InputArchive& shared, torch::serialize::InputArchive* own,
                    const std::vector<int>& fromSaved);

  /// The planning rule itself, without communication: the plan all ranks derive from
  /// `estimates` and the relative standard error of each rank's per-sample estimate,
  /// given the current plan. A current plan that breaks a cap is always replaced;
  /// otherwise the solver's plan is adopted when its predicted gain is above
  /// options.hysteresis of the step time and above options.confidence standard errors
  /// of the gain. Public for tests and tools.
  static BatchPlan choose(const std::vector<RankCost>& estimates, const BatchPlan& current,
                          const PlannerOptions& options,
                          const std::vector<double>& relativeErrors = {});

  /// One plan update as every rank makes it after the exchange: the costs from the
  /// ranks' estimates (what is not measured is kept from `previous`), then choose().
  /// `calibrating`: no plan has come from measurements yet; the first update at which
  /// every rank has measured adopts the solver's split outright. Public for tests.
  /// A move proposed by consecutive updates but not adopted yet (confirmations).
  struct Proposal {
    std::vector<int64_t> local;  // empty: none
    int count = 0;
  };
  struct Decision {
    BatchPlan plan;
    std::vector<RankCost> costs;
    std::vector<double> errors;
    bool calibrated = false;  // this update was the calibration
    /// The move this update proposed and did not adopt yet (pass it to the next).
    Proposal proposal;
  };
  /// `pending`: what the update before proposed (its Decision::proposal).
  static Decision decide(const std::vector<RankEstimator::Estimate>& estimates,
                         const std::vector<RankCost>& previous, const BatchPlan& current,
                         const PlannerOptions& options, bool calibrating, const Proposal& pending);
  /// decide() with nothing pending.
  static Decision decide(const std::vector<RankEstimator::Estimate>& estimates,
                         const std::vector<RankCost>& previous, const BatchPlan& current,
                         const PlannerOptions& options, bool calibrating) {
    return decide(estimates, previous, current, options, calibrating, Proposal{});
  }

 private:
  Communicator& comm_;
  PlannerOptions options_;
  BatchPlan plan_;
  std::vector<RankCost> costs_;
  RankEstimator estimator_;
  MemoryEstimator memory_;
  /// Per rank, from the exchange; costs_[r].maxSamples keeps the given or learned cap.
  std::vector<int64_t> derivedCaps_;
  bool derivedCapsDropped_ = false;  // said once: they could not hold the global batch
  /// `costs` with each rank's cap lowered to its derived cap, unless those caps could
  /// not hold the global batch together.
  std::vector<RankCost> withDerivedCaps(std::vector<RankCost> costs);
  int64_t firstUpdate() const;
  /// The per-rank costs and memory caps of a saved state (save()'s "costs", "caps").
  std::vector<RankCost> readCosts(torch::serialize::InputArchive& shared) const;

  int64_t step_ = 0;
  double lastExchangeSeconds_ = 0.0;
  /// Whether a plan has been derived from every rank's measurements yet.
  bool measured_ = false;
  Proposal pending_;      // a move waiting for its confirmation
  bool probing_ = false;  // the plan gives a rank at 0 samples one sample to measure it
  /// The plan with one sample for each rank at 0 that is worth probing (probeEvery).
  BatchPlan withProbes(const BatchPlan& plan) const;
};

}  // namespace hddp
