// The Trainer: the training loop that puts the layers together.
//
// Each step: prefetched batch (this rank's share under the planner's split) ->
// autocast forward -> loss -> scaled backward with the gradient allreduce overlapped ->
// unscale, optional gradient clipping, optimizer step (skipped on every rank together
// when an fp16 gradient overflowed) -> scaler update -> planner update. Around it:
// JSON-lines metrics per rank, a progress bar on rank 0, an optional Chrome-trace
// timeline, periodic atomic state saves and exact resume.
//
//   auto ctx = hddp::initFromEnv();
//   hddp::TrainerOptions options;
//   options.globalBatch = 128;
//   options.epochs = 5;
//   hddp::Trainer trainer(*ctx.communicator, model.ptr(), hddp::forwardOf(model),
//                         hddp::crossEntropy(), optimizer, dataset, options);
//   trainer.fit();
//
// The model must already be on the rank's device (cuda:0, emu:1, cpu: what --device,
// HDDP_DEVICE or the launcher chose); the Trainer computes there, whatever device the
// communicator stages its tensors on (the CPU under Gloo). Every rank constructs the
// Trainer with the same options and calls fit(); rank 0 writes state files, all ranks
// load them.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hddp/amp/amp_mode.h"
#include "hddp/amp/grad_scaler.h"
#include "hddp/balance/emulation.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/launch.h"
#include "hddp/core/step_timer.h"
#include "hddp/data/loader.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "hddp/train/part.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace hddp {

enum class ProgressMode {
  /// A live bar on rank 0 when stderr is a terminal, plain lines otherwise. Default.
  Auto,
  /// Plain lines every logEvery steps on rank 0.
  Lines,
  Off,
};

struct TrainerOptions {
  /// Samples per optimizer step over all ranks. Default 128.
  int64_t globalBatch = 128;
  /// Default 1.
  int64_t epochs = 1;
  /// Stop after this many steps in total (0: when the epochs are done). Default 0.
  int64_t maxSteps = 0;
  /// Train for at most this many seconds of fit() (0: no limit), evaluations during the
  /// run included, the final one not: every 10 steps the ranks agree (one 24-byte
  /// allreduce) on the slowest rank's seconds per training step, and the run stops at
  /// the last step that fits. StepInfo::totalSteps follows, so a schedule that reads it
  /// (the example trainers' cosine) ends on time. Not kept in state files: a resumed
  /// run has the whole budget again. Default 0.
  double timeBudgetSeconds = 0;
  /// The clock the time budget reads (its measurements, the evaluations it leaves out,
  /// the account a state file carries to a launcher's restart): seconds from any fixed
  /// origin, never decreasing. For tests and simulations (a fixed number of seconds per
  /// step makes the step at which the budget ends the run exact); default (empty) the
  /// steady clock. Called on the training thread only; a clock that goes back fails
  /// fit() on every rank with a ConfigError.
  std::function<double()> budgetClock;
  /// Shuffle and augmentation seed (the sampler's and the loader's). Default 0.
  uint64_t seed = 0;
  AmpMode amp = AmpMode::Off;
  /// With amp = Bf16 on a device that lacks native bfloat16 (a CPU without avx512_bf16,
  /// amx_bf16 or Arm bf16; a GPU before compute capability 8.0), train in float32 and
  /// log it: emulated bf16 is slower than float32. false keeps bf16 anyway. Default:
  /// HDDP_BF16_FALLBACK (true).
  std::optional<bool> bf16Fallback;
  /// Clip the global gradient norm to this value after unscaling; 0 = off. Default 0.
  double clipGradNorm = 0.0;
  /// Split the global batch by measured speed (BatchPlanner); false = equal split as
  /// PyTorch DDP. Default true.
  bool balance = true;
  /// How the planner measures and decides (the batch it splits is globalBatch above).
  /// The default plans first after 3 calibration steps, then every 10 steps.
  PlannerSettings planner = defaultPlannerSettings();
  /// With balancing, split the first step by each rank's device and link already: each
  /// rank probes its link (sysfs; pinned copy bandwidth on a device, ~0.1 s), takes its
  /// input bytes per sample from the dataset, and times forward passes of 8 samples in
  /// eval mode without gradients (the fastest of three; compute per sample ~3x a forward); the
  /// ranks exchange the costs (hddp/balance/cost_model.h) and the planner starts from their split.
  /// false: start from the equal split. Default true.
  bool seedPlan = true;
  DdpOptions ddp;
  /// ZeRO (hddp/ddp/sharded_optimizer.h): 0 plain data parallelism (the default), 1 the
  /// optimizer state is sharded across ranks, 2 the gradients too. SGD, Adam and AdamW
  /// only; not with gradient compression (ConfigError).
  int zero = 0;
  /// With zero > 0: how the shards are sized. Default: by each rank's free device memory
  /// after the model (on a rank where it cannot be measured, a CPU rank without
  /// emulated memory, every rank falls back to equal shards and logs it).
  ShardBy shardBy;
  /// Workers, prefetch depth, drop-last. Its device, seeds and the sampler seed are set
  /// by the Trainer.
  LoaderOptions loader;
  /// Used with AmpMode::Fp16 (enabled is set by the Trainer).
  GradScalerOptions scaler;
  /// Progress lines every this many steps (the metrics file has a record for every step).
  /// Default 20.
  int64_t logEvery = 20;
  /// JSON lines, one per step, epoch and run; "" = none. Rank 0 writes this path,
  /// rank r > 0 writes it with ".rank<r>" before the extension.
  std::string metricsPath;
  /// Chrome-trace / Perfetto JSON of every rank's phases, written by rank 0 at the end
  /// of fit(); "" = off (the default, and then nearly free).
  std::string timelinePath;
  /// Folder for TensorBoard event files (`tensorboard --logdir` it); "" = off (the
  /// default). Rank 0 writes one file per fit() at the global step: the training loss
  /// of its share, samples/s, learning rate, every rank's share of the batch, its own
  /// step-time parts and memory, the epochs' loss and evaluation, and the split as
  /// text when it changes (hddp/train/tensorboard.h; docs/train.md). A folder rank 0
  /// cannot write fails fit() on every rank with hddp::ConfigError (and an hddp built
  /// without protobuf refuses the option in the constructor); a write that fails later
  /// is logged and ends TensorBoard output only, not the run.
  std::string tensorboard;
  ProgressMode progress = ProgressMode::Auto;
  /// Directory for state files; "" = never save. Default "".
  std::string saveDir;
  /// Save every this many steps (0: only at the end of each epoch and of the run).
  int64_t saveEvery = 0;
  /// State files kept in saveDir. Default 3.
  int keepLast = 3;
  /// Resume from a state file, or from the newest valid one in a directory; "" = start
  /// fresh. Default "".
  std::string resume;
  /// When the launcher restarted this program (LaunchInfo::jobRestarts > 0, as
  /// hddp-run --max-restarts, torchrun and a requeued Slurm job set it) and `resume` is
  /// empty, resume from the newest valid state in saveDir (starting fresh when it holds
  /// none). Default true.
  bool resumeOnRestart = true;
  /// What the launcher said about this process: the job's restarts, and an elastic
  /// job's slot and commit folder. Default: detectJob() of the environment; give
  /// DistributedContext::info (initFromEnv) to say it once.
  std::optional<LaunchInfo> launch;
  /// Memory caps given per rank: the most samples rank r may get in a step (0 = no
  /// cap); empty = none. With balancing the planner keeps every share within its cap;
  /// with the equal split a share above its cap is a ConfigError.
  std::vector<int64_t> maxLocalBatch;
  /// When a rank runs out of device memory (c10::OutOfMemoryError) in forward or
  /// backward, every rank abandons the step together, the failing rank's memory cap is
  /// set 10% below the share that failed, the planner re-splits the batch and the same
  /// samples are trained again: nothing is applied twice or lost. The caps are kept in
  /// state files. Needs balancing (with the equal split the error says what to do);
  /// not with SyncBatchNorm, whose collectives run in forward. Reading the step's
  /// status waits for the device once per step, between backward and the optimizer
  /// step (free on CPU); set false to drop that on cards that have room. Default true.
  bool recoverFromOutOfMemory = true;
  /// Heterogeneity emulation (tests, demos); default: HDDP_EMULATE_SLOWDOWN /
  /// HDDP_EMULATE_LINK_GBPS / HDDP_EMULATE_MEMORY_CAP of the environment.
  std::optional<EmulationOptions> emulation;
  /// What measures each step's compute time for the planner. Default (null): the host
  /// clock on a CPU device (Gloo's waits block the host and are left out), events on
  /// the device's stream otherwise (NCCL's waits do not block the host, so host time
  /// would count the wait for a slower rank as compute). Give one for a device hddp has
  /// no timer for, or in tests.
  std::function<std::unique_ptr<StepTimer>(const c10::Device&)> stepTimer;
  /// The other times the planner learns from, for tests and simulations (as budgetClock
  /// is for the time budget): `now` (seconds from any fixed origin) times the seed's
  /// forward passes and an emulated slower card's marks; `sleep` waits out the
  /// emulator's extra time. A test whose model advances a clock of its own by a known
  /// time per sample, read here and by its stepTimer, gets the same plans on any
  /// machine, loaded or not (tests/support/virtual_time.h). Both are called on the
  /// training thread and, for the bucket marks, on autograd's, one at a time. Empty: the
  /// steady clock (the emulator then leaves out the time the thread waited for a core)
  /// and a real sleep.
  struct MeasurementClock {
    std::function<double()> now;
    Emulator::Sleep sleep;
  };
  MeasurementClock measurementClock;

  static PlannerSettings defaultPlannerSettings() {
    PlannerSettings p;
    p.calibrationSteps = 3;
    return p;
  }
};

/// What resolveOptions takes besides the options: facts about this rank that the Trainer
/// finds (its device, whether the device has native bf16, the launcher's commit folder,
/// the model).
struct RankFacts {
  /// The rank's device (its model's).
  c10::Device device = c10::Device(c10::kCPU);
  /// With amp = Bf16: whether bf16 falls back to float32 where it is not native
  /// (TrainerOptions::bf16Fallback, else HDDP_BF16_FALLBACK), and whether the device has
  /// it natively and why (hddp/topology/topology.h: bf16Support).
  bool bf16Fallback = true;
  bool bf16Native = true;
  std::string bf16Why;
  /// An elastic job's commit folder (LaunchInfo::elasticDir; empty: not an elastic job).
  std::string elasticDir;
  /// The model has a SyncBatchNorm.
  bool hasSyncBatchNorm = false;
};

/// What was decided, and why (for the log).
struct ResolvedOptions {
  TrainerOptions options;
  struct Note {
    bool warn = false;       // a warning, else information
    bool everyRank = false;  // each rank says it (its own device's), else rank 0 for all
    std::string text;
  };
  std::vector<Note> notes;
};

/// The options as the Trainer runs them, from the options given and the rank's facts; no
/// input or output of its own (tested alone: tests/train/resolve_options_test.cpp):
/// - saveDir: the elastic job's commit folder when none is given;
/// - amp: Bf16 becomes Off where bf16 is not native and falls back;
/// - ddp.compression: Auto becomes None with ZeRO (each bucket goes to its owner whole);
/// - planner.minLocalBatch: at least 1 with SyncBatchNorm (its collectives run in
///   forward, so every rank needs a sample in every step);
/// - loader: the device, the seeds (TrainerOptions::seed) and the sampler's minimum share.
/// Later decisions (the compression `Auto` chooses from the seed's timing, the one a state
/// file brings back) are the Trainer's: Trainer::resolvedOptions().
ResolvedOptions resolveOptions(TrainerOptions given, const RankFacts& facts);

/// Thread safety: one thread drives a Trainer (construction, fit, save, load, the
/// accessors); its schedule and evaluation callbacks run on that thread, and it runs
/// its own loader threads. Ownership: it keeps references to the communicator and the
/// optimizer, which must outlive it, and shares the model and datasets.
class Trainer {
 public:
  using ForwardFn = std::function<at::Tensor(const at::Tensor& input)>;
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
  /// Called before every step (set the learning rate from info.step, for instance).
  using ScheduleFn = std::function<void(const StepInfo& info, torch::optim::Optimizer& optimizer)>;
  /// Called at the end of every epoch on every rank (it may use collectives), and once
  /// more when maxSteps stops the run inside an epoch; the returned metrics go to the
  /// epoch's metrics line and the progress output. An empty map means "not evaluated
  /// this time" (TrainSummary::lastEvaluation keeps the last non-empty one).
  using EvalFn = std::function<std::map<std::string, double>(int64_t epoch)>;

  Trainer(Communicator& communicator, std::shared_ptr<torch::nn::Module> model, ForwardFn forward,
          LossFn loss, torch::optim::Optimizer& optimizer, std::shared_ptr<const Dataset> train,
          TrainerOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void setSchedule(ScheduleFn schedule);
  void setEvaluation(EvalFn evaluation);
  /// Adds a part of the program's own to the loop (hddp/train/part.h: its hooks, its
  /// state in the state files, and the contract: every rank adds the same parts in the
  /// same order). Called before fit() (and before a load() that should restore the
  /// part's state). hddp::ConfigError for a null part, a name that is empty, longer than
  /// 64 characters or has other characters than letters, digits, '_' and '-', or a name
  /// another part has.
  void addPart(std::shared_ptr<TrainerPart> part);

  /// Trains until options.epochs (or maxSteps); resumes first when options.resume is set.
  TrainSummary fit();
  /// Saves the state now into saveDir (collective: every rank calls it); returns the
  /// file written by rank 0.
  std::string save();
  /// Loads a state file, or the newest valid one in a directory (collective). A file
  /// that is damaged, not hddp's or does not fit is an hddp::StateError on every rank,
  /// found before anything is changed: the Trainer goes on as it was. Running out of
  /// memory (c10::OutOfMemoryError, std::bad_alloc) or a device's failure
  /// (c10::AcceleratorError) passes as it is on the rank that met it (an hddp::Error on
  /// the others). A load that fails after it began to copy the file in (an optimizer's
  /// own load refusing its entries, memory running out) leaves the Trainer half loaded,
  /// alike on every rank: fit(), save() and load() then throw hddp::Error telling to
  /// construct a new Trainer.
  void load(const std::string& fileOrDirectory);

  int64_t step() const;
  int64_t epoch() const;
  /// True once maxSteps or the time budget has ended the run before its epochs (so an
  /// evaluation callback knows the run is ending).
  bool stoppedEarly() const;
  DistributedDataParallel& ddp();
  /// The device this rank trains on: its model's (not the communicator's).
  c10::Device device() const;
  /// Null when options.balance is false.
  BatchPlanner* planner();
  /// The mixed precision this rank trains with: TrainerOptions::amp, or float32 where
  /// bf16 was asked for on a device without native bf16 (bf16Fallback).
  AmpMode ampMode() const;
  /// The split the next step uses: the planner's, or the equal split without balancing.
  /// Spread other per-rank work like it with shardOf (hddp/balance/batch_plan.h).
  BatchPlan plan() const;
  GradScaler& scaler();
  PrefetchLoader& loader();
  /// The options as given to the constructor.
  const TrainerOptions& options() const;
  /// The options as the Trainer runs them: resolveOptions() of the given ones, then the
  /// compression `Auto` chose and the one a loaded state file brought back.
  const TrainerOptions& resolvedOptions() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// `[holder](x) { return holder->forward(x); }` for any module holder.
template <typename Holder>
Trainer::ForwardFn forwardOf(Holder holder) {
  return [holder](const at::Tensor& x) mutable { return holder->forward(x); };
}

/// Mean cross-entropy over the batch (classification, and segmentation with
/// [N, K, H, W] logits and [N, H, W] targets). `labelSmoothing` in [0, 1) mixes each
/// target with the uniform distribution (Szegedy et al. 2016); still a mean over
/// samples, so the weighted gradients stay exact.
Trainer::LossFn crossEntropy(double labelSmoothing = 0.0);

/// The module's parameters with each tensor once: LibTorch's `parameters()` lists a
/// tied tensor (one weight registered under two names) once per name, so an optimizer
/// built from it steps that tensor twice and a norm counts it twice. Build optimizers
/// from this. Order: first appearance in `parameters()`.
std::vector<at::Tensor> uniqueParameters(const torch::nn::Module& module);

/// Sets every parameter group's learning rate (SGD, Adam, AdamW, RMSprop, Adagrad).
void setLearningRate(torch::optim::Optimizer& optimizer, double lr);

}  // namespace hddp
