// The online batch planner: measured speed in, split of the global batch out.
//
// Each rank records the compute time of its steps (excluding time blocked in
// communication). Every `rebalanceEvery` steps the ranks exchange their estimates (one
// small allgather) and every rank solves the same split from the same numbers, so all
// derive the identical plan without a further round trip. The estimate of a rank is the
// median seconds per sample over its last `window` steps (robust to outliers); the
// solver equalises predicted times, and since it re-measures at the sizes actually
// used, it converges on equal measured times even when cost per sample depends on the
// batch size. Hysteresis: once a plan comes from measurements, a new plan is adopted
// only when it improves the predicted step time by more than `hysteresis` (relative)
// and by more than the measured noise, so the split does not oscillate on noise; a rank whose speed
// changes (a throttling enclosure) moves the split within about window + rebalanceEvery steps.
#pragma once

#include <deque>
#include <vector>

#include "hddp/balance/batch_plan.h"
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
  /// no noise threshold): the plan it replaces was a guess, not a measured choice.
  int calibrationSteps = 0;
  /// Steps in each rank's median. Default 5.
  int window = 5;
  /// Minimum relative improvement of the predicted step time to adopt a new plan.
  /// Default 0.03.
  double hysteresis = 0.03;
  /// The threshold also grows with measured noise: at least noiseMultiplier x the
  /// largest relative median absolute deviation of the ranks' windows (3 ~ 2 sigma),
  /// so the plan does not chase noise. Default 3.0; 0 turns it off.
  double noiseMultiplier = 3.0;
  /// Smallest share per rank (1 with SyncBatchNorm, whose layers need a sample on every
  /// rank). Default 0.
  int64_t minLocalBatch = 0;
};

struct PlannerOptions : PlannerSettings {
  explicit PlannerOptions(int64_t globalBatch, const PlannerSettings& settings = {})
      : PlannerSettings(settings), globalBatch(globalBatch) {}
  int64_t globalBatch;
};

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
  /// Ends a step; every rank calls it every step. Every rebalanceEvery steps it
  /// exchanges estimates and may change the plan; returns true when it did.
  bool endStep();

  /// The per-rank costs behind the last plan update (for metrics and hddp-probe).
  const std::vector<RankCost>& costs() const { return costs_; }
  /// Seconds the last endStep() spent exchanging estimates (its allgather); 0 when
  /// that step exchanged nothing.
  double lastExchangeSeconds() const { return lastExchangeSeconds_; }

  /// Caps `rank`'s share at `maxSamples` (memory: learned from an allocation failure,
  /// or given) and re-plans at once, without hysteresis, from the last estimates (an
  /// equal cost per sample before any). Every rank must make the same calls. Throws
  /// hddp::ConfigError when the caps can no longer hold the global batch. Returns
  /// true when the plan changed.
  bool setMemoryCap(int rank, int64_t maxSamples);
  /// Each rank's memory cap (std::numeric_limits<int64_t>::max() = none).
  std::vector<int64_t> memoryCaps() const;
  int64_t step() const { return step_; }

  /// Everything needed to resume the planner at the same step (the Trainer's state
  /// file). `window` is this rank's own measurements; the rest is identical on all ranks.
  struct State {
    BatchPlan plan;
    int64_t step = 0;
    std::vector<double> window;
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
  /// Reads what save() wrote (restore() rules apply); hddp::StateError when an entry is
  /// missing.
  void load(torch::serialize::InputArchive& shared, torch::serialize::InputArchive& own);

  /// The planning rule itself, without communication: the plan all ranks derive from
  /// `estimates` (and each rank's relative noise, e.g. MAD/median of its window), given
  /// the current plan. A current plan that breaks a cap is always replaced. Public for
  /// tests and tools.
  static BatchPlan choose(const std::vector<RankCost>& estimates, const BatchPlan& current,
                          const PlannerOptions& options,
                          const std::vector<double>& relativeNoise = {});

 private:
  Communicator& comm_;
  PlannerOptions options_;
  BatchPlan plan_;
  std::vector<RankCost> costs_;
  std::deque<double> secondsPerSample_;
  int64_t firstUpdate() const;

  int64_t step_ = 0;
  double lastExchangeSeconds_ = 0.0;
  /// Whether a plan has been derived from every rank's measurements yet.
  bool measured_ = false;
};

}  // namespace hddp
