#include "hddp/train/trainer.h"

#include <ATen/core/Generator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>
#include <utility>

#include "hddp/core/autocast.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "hddp/train/state_file.h"
#include "hddp/train/timeline.h"
#include "train/metrics.h"

namespace hddp {

AmpMode parseAmpMode(const std::string& text) {
  if (text == "off" || text == "none" || text == "fp32") {
    return AmpMode::Off;
  }
  if (text == "bf16" || text == "bfloat16") {
    return AmpMode::Bf16;
  }
  if (text == "fp16" || text == "float16" || text == "half") {
    return AmpMode::Fp16;
  }
  HDDP_THROW(ConfigError, "unknown mixed-precision mode '", text, "': use off, bf16 or fp16");
}

const char* ampModeName(AmpMode mode) noexcept {
  switch (mode) {
    case AmpMode::Off:
      return "off";
    case AmpMode::Bf16:
      return "bf16";
    case AmpMode::Fp16:
      return "fp16";
  }
  return "?";
}

Trainer::LossFn crossEntropy() {
  return [](const at::Tensor& output, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(output.to(at::kFloat), target);
  };
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    auto& options = group.options();
    if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::AdagradOptions*>(&options)) {
      o->lr(lr);
    } else {
      options.set_lr(lr);
    }
  }
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kStateVersion = 1;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string archiveBytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

at::Tensor bytesTensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) {
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  }
  return t;
}

std::string tensorBytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kByte);
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

at::Tensor readTensor(torch::serialize::InputArchive& archive, const std::string& key,
                      const std::string& path) {
  at::Tensor t;
  HDDP_CHECK_AS(StateError, archive.try_read(key, t), "state file ", path, " has no '", key,
                "' (written by another program or an incompatible hddp version?)");
  return t;
}

at::Tensor generatorState(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void setGeneratorState(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

class Trainer::Impl {
 public:
  Impl(Communicator& comm, std::shared_ptr<torch::nn::Module> model, ForwardFn forward, LossFn loss,
       torch::optim::Optimizer& optimizer, std::shared_ptr<const Dataset> train,
       TrainerOptions options)
      : comm_(comm),
        model_(std::move(model)),
        forward_(std::move(forward)),
        loss_(std::move(loss)),
        optimizer_(optimizer),
        options_(std::move(options)),
        device_(comm.device()),
        timeline_(!options_.timelinePath.empty()) {
    HDDP_CHECK_AS(ConfigError, model_ != nullptr && forward_ && loss_,
                  "Trainer needs a model, a forward function and a loss function");
    HDDP_CHECK_AS(ConfigError, train != nullptr && train->size() > 0,
                  "Trainer needs a non-empty training dataset");
    HDDP_CHECK_AS(ConfigError, options_.globalBatch >= comm.size(), "global batch ",
                  options_.globalBatch, " is smaller than the number of ranks (", comm.size(), ")");
    HDDP_CHECK_AS(ConfigError, options_.epochs >= 1 && options_.maxSteps >= 0,
                  "TrainerOptions: epochs must be >= 1 and maxSteps >= 0");
    HDDP_CHECK_AS(ConfigError, options_.keepLast >= 1, "TrainerOptions::keepLast must be >= 1");
    HDDP_CHECK_AS(ConfigError, options_.saveEvery == 0 || !options_.saveDir.empty(),
                  "saveEvery is set but saveDir is empty: say where state files go");
    HDDP_CHECK_AS(ConfigError,
                  options_.globalBatch <= train->size() || !options_.loader.sampler.dropLast,
                  "global batch ", options_.globalBatch, " exceeds the dataset (", train->size(),
                  " samples) with dropLast: no step would run");
    if (options_.amp == AmpMode::Fp16) {
      HDDP_CHECK_AS(ConfigError, device_.is_cuda(),
                    "fp16 mixed precision needs a CUDA device; on CPU use bf16");
    }
    const int rank = comm.rank();
    ddp_ = std::make_unique<DistributedDataParallel>(model_, comm, options_.ddp);
    for (const auto& module : model_->modules(/*include_self=*/true)) {
      hasSyncBatchNorm_ = hasSyncBatchNorm_ || dynamic_cast<SyncBatchNormImpl*>(module.get());
    }
    PlannerOptions po = options_.planner;
    po.globalBatch = options_.globalBatch;
    if (hasSyncBatchNorm_ && po.minLocalBatch < 1) {
      // SyncBatchNorm's collectives run in forward: a rank without samples would skip
      // them while the others wait. Every rank keeps at least one sample in every step.
      po.minLocalBatch = 1;
      HDDP_LOG_INFO("train", "SyncBatchNorm: every rank gets at least one sample per step");
    }
    options_.planner = po;
    if (options_.balance) {
      planner_ = std::make_unique<BatchPlanner>(comm, po);
    }
    applyGivenMemoryCaps();
    GradScalerOptions so = options_.scaler;
    so.enabled = options_.amp == AmpMode::Fp16;
    scaler_ = std::make_unique<GradScaler>(so, &comm);
    LoaderOptions lo = options_.loader;
    lo.device = device_;
    lo.seed = options_.seed;
    lo.sampler.seed = options_.seed;
    lo.sampler.minLocalBatch = std::max(lo.sampler.minLocalBatch, po.minLocalBatch);
    options_.loader = lo;
    loader_ = std::make_unique<PrefetchLoader>(std::move(train), rank, lo);
    EmulationOptions emulation =
        options_.emulation ? *options_.emulation : emulationFromEnv(rank, comm.size());
    emulator_ = std::make_unique<Emulator>(emulation, rank);
    HDDP_LOG_INFO("train", "rank ", rank, "/", comm.size(), " on ", device_.str(), ": ",
                  loader_->dataset().describe(), "; global batch ", options_.globalBatch, ", ",
                  options_.epochs, " epochs, amp ", ampModeName(options_.amp), ", ",
                  options_.balance ? "planner" : "equal split", ", ", lo.workers,
                  " loader workers, prefetch depth ", lo.depth);
  }

  ~Impl() {
    try {
      loader_->stop();
    } catch (...) {
    }
  }

  void applyGivenMemoryCaps() {
    const auto& caps = options_.maxLocalBatch;
    if (caps.empty()) {
      return;
    }
    HDDP_CHECK_AS(ConfigError, static_cast<int>(caps.size()) == comm_.size(),
                  "TrainerOptions::maxLocalBatch has ", caps.size(), " entries for ", comm_.size(),
                  " ranks: give one per rank (0 = no cap)");
    for (int r = 0; r < comm_.size(); ++r) {
      const int64_t cap = caps[static_cast<size_t>(r)];
      HDDP_CHECK_AS(ConfigError, cap >= 0, "TrainerOptions::maxLocalBatch for rank ", r, " is ",
                    cap, ": use a number of samples, or 0 for no cap");
      if (cap == 0) {
        continue;
      }
      if (planner_) {
        planner_->setMemoryCap(r, cap);
      } else {
        const int64_t share = equalSplit(comm_.size(), options_.globalBatch).local[r];
        HDDP_CHECK_AS(ConfigError, share <= cap, "rank ", r, " can hold ", cap,
                      " samples but its equal share of the global batch ", options_.globalBatch,
                      " is ", share, ": turn balancing on (so the planner respects the cap) or ",
                      "lower the global batch");
      }
    }
  }

  BatchPlan currentPlan() const {
    return planner_ ? planner_->plan() : equalSplit(comm_.size(), options_.globalBatch);
  }

  // ---- the loop ------------------------------------------------------------------------

  TrainSummary fit() {
    if (!options_.resume.empty()) {
      load(options_.resume);
    }
    const int rank = comm_.rank();
    const bool appendMetrics = resumed_;
    metrics_ =
        train::MetricsWriter(train::metricsPathForRank(options_.metricsPath, rank), appendMetrics);
    const bool showProgress = rank == 0 && options_.progress != ProgressMode::Off;
    const bool live = options_.progress == ProgressMode::Auto && ::isatty(STDERR_FILENO);
    progress_ = std::make_unique<train::Progress>(showProgress, live, options_.logEvery);
    // A common time zero for the timeline.
    barrier();
    timeline_.setOrigin(Clock::now());

    TrainSummary summary;
    const auto start = Clock::now();
    const int64_t startStep = step_;
    int64_t samples = 0;
    bool stopEarly = false;
    while (epoch_ < options_.epochs && !stopEarly) {
      model_->train();
      if (midEpoch_) {
        loader_->resume(samplerState_, currentPlan());
        midEpoch_ = false;
      } else {
        loader_->startEpoch(epoch_, currentPlan());
      }
      epochLossSum_ = 0;
      epochSamples_ = 0;
      const auto epochStart = Clock::now();
      int64_t epochSteps = 0;
      for (;;) {
        if (options_.maxSteps > 0 && step_ >= options_.maxSteps) {
          stopEarly = true;
          break;
        }
        const auto waitStart = Clock::now();
        auto batch = loader_->next();
        if (!batch) {
          break;
        }
        timeline_.add("data wait", waitStart, Clock::now(), step_);
        if (!runStep(*batch)) {
          continue;  // a rank ran out of memory: the step is repeated under a new split
        }
        samples += batch->share.globalBatch;
        ++epochSteps;
        if (options_.saveEvery > 0 && step_ % options_.saveEvery == 0) {
          samplerState_ = loader_->state();
          midEpoch_ = true;
          summary.lastStateFile = save();
          midEpoch_ = false;
          lastSaved_ = step_;
        }
      }
      if (stopEarly) {
        samplerState_ = loader_->state();
        midEpoch_ = true;  // a resume continues inside this epoch
        break;
      }
      endEpoch(epochStart, epochSteps, summary);
      ++epoch_;
      if (!options_.saveDir.empty()) {
        summary.lastStateFile = save();
      }
    }
    if (stopEarly && evaluation_) {
      // maxSteps ended the run inside an epoch: evaluate what was trained.
      const auto e0 = Clock::now();
      auto evaluation = evaluation_(epoch_);
      timeline_.add("evaluation", e0, Clock::now(), step_);
      model_->train();
      if (!evaluation.empty()) {
        lastEvaluation_ = evaluation;
        nlohmann::json record{
            {"kind", "evaluation"}, {"rank", rank}, {"epoch", epoch_}, {"step", step_}};
        std::ostringstream line;
        line.precision(4);
        line << "step " << step_ << " (epoch " << epoch_ + 1 << ", stopped by maxSteps):";
        const char* sep = " ";
        for (const auto& [k, v] : evaluation) {
          record[k] = v;
          line << sep << k << " " << v;
          sep = ", ";
        }
        line << " (split " << currentPlan().describe() << ")";
        metrics_.write(record);
        progress_->line(line.str());
      }
    }
    if (stopEarly && !options_.saveDir.empty() && lastSaved_ != step_) {
      summary.lastStateFile = save();
    }
    summary.steps = step_ - startStep;
    summary.totalSteps = step_;
    summary.seconds = seconds(start, Clock::now());
    summary.samplesPerSecond = summary.seconds > 0 ? samples / summary.seconds : 0.0;
    summary.lastTrainLoss = lastEpochLoss_;
    summary.repeatedSteps = repeatedSteps_;
    summary.lastEvaluation = lastEvaluation_;
    if (timeline_.enabled()) {
      timeline_.write(comm_, options_.timelinePath);
    }
    nlohmann::json record{{"kind", "summary"},
                          {"rank", rank},
                          {"steps", summary.steps},
                          {"total_steps", summary.totalSteps},
                          {"epochs_completed", summary.epochsCompleted},
                          {"seconds", summary.seconds},
                          {"samples_per_s", summary.samplesPerSecond},
                          {"train_loss", summary.lastTrainLoss},
                          {"repeated_steps", summary.repeatedSteps}};
    for (const auto& [k, v] : lastEvaluation_) {
      record[k] = v;
    }
    metrics_.write(record);
    std::ostringstream line;
    line << "done: " << summary.steps << " steps in " << summary.seconds << " s ("
         << static_cast<int64_t>(summary.samplesPerSecond) << " samples/s)";
    progress_->line(line.str());
    return summary;
  }

  // False when the step was abandoned (some rank ran out of memory): nothing was
  // applied, and the loader serves the same samples again under the new split.
  bool runStep(const Batch& batch) {
    const int64_t local = batch.share.localBatch;
    const int64_t global = batch.share.globalBatch;
    StepInfo info{step_, epoch_, batch.stepInEpoch, batch.stepInEpoch + loader_->stepsLeftInEpoch(),
                  local, global};
    if (schedule_) {
      schedule_(info, optimizer_);
    }
    // Emulation: a slower card computes longer (before its gradients are sent), a
    // slower link takes longer to move the batch. Estimated from the last step.
    const double rawGuess = perSample_ * static_cast<double>(local);
    double extra = 0;
    if (emulator_->active()) {
      const auto e0 = Clock::now();
      extra = emulator_->apply(rawGuess, batch.bytes) - rawGuess;
      timeline_.add("emulated delay", e0, Clock::now(), step_);
    }
    const auto t0 = Clock::now();
    ddp_->setBatch(local, global);
    optimizer_.zero_grad();
    at::Tensor loss;
    auto tForward = t0;
    std::string outOfMemory;  // this rank's allocation failure, if any
    if (local > 0) {
      try {
        {
          std::optional<AutocastGuard> autocast;
          if (options_.amp != AmpMode::Off) {
            autocast.emplace(device_.type(),
                             options_.amp == AmpMode::Bf16 ? at::kBFloat16 : at::kHalf);
          }
          at::Tensor output = forward_(batch.input);
          emulator_->checkMemory(local);
          loss = loss_(output, batch.target);
        }
        tForward = Clock::now();
        timeline_.add("forward", t0, tForward, step_, 0, local);
        scaler_->scale(loss).backward();
      } catch (const c10::OutOfMemoryError& e) {
        if (!options_.recoverFromOutOfMemory || hasSyncBatchNorm_) {
          throw;  // (SyncBatchNorm's collectives in forward cannot be matched)
        }
        outOfMemory = e.what_without_backtrace();
        loss = at::Tensor();
      }
    } else {
      ddp_->finalize();  // no samples this step: contribute zeros, receive the others'
    }
    if (!outOfMemory.empty()) {
      if (device_.type() != c10::kCPU) {
        c10::getDeviceAllocator(device_.type())->emptyCache();
      }
      HDDP_CHECK(ddp_->abandonStep(), "rank ", comm_.rank(), " ran out of memory after its ",
                 "gradients were sent (", outOfMemory, "); this cannot be retried");
    }
    if (options_.recoverFromOutOfMemory && !hasSyncBatchNorm_ && ddp_->lastStepAbandoned()) {
      recoverFromOutOfMemory(batch, outOfMemory, t0);
      return false;
    }
    const auto tBackward = Clock::now();
    timeline_.add("backward", tForward, tBackward, step_, 0, local);
    if (options_.clipGradNorm > 0) {
      scaler_->unscale(optimizer_);
      torch::nn::utils::clip_grad_norm_(model_->parameters(), options_.clipGradNorm);
    }
    const bool stepped = scaler_->step(optimizer_);
    scaler_->update();
    if (device_.type() != c10::kCPU) {
      // Wait for the device, so the measured compute time is the real one.
      c10::Event done(device_.type());
      done.record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
      done.synchronize();
    }
    const auto tEnd = Clock::now();
    timeline_.add("optimizer", tBackward, tEnd, step_);
    const auto& stats = ddp_->lastStepStats();
    for (const auto& bucket : stats.bucketTimes) {
      timeline_.add("allreduce", bucket.launched, bucket.completed, step_, 1, bucket.bytes);
    }
    const double raw = std::max(0.0, seconds(t0, tEnd) - stats.waitSeconds);
    if (emulator_->active() && rawGuess == 0 && local > 0) {
      // No estimate before this (first) step: stretch it now, after the fact, so the
      // planner's calibration sees the emulated speed from the first step on.
      const auto e0 = Clock::now();
      extra += emulator_->apply(raw, 0) - raw;
      timeline_.add("emulated delay", e0, Clock::now(), step_);
    }
    if (local > 0) {
      perSample_ = raw / static_cast<double>(local);
    }
    const double compute = raw + extra;
    bool replanned = false;
    if (planner_) {
      planner_->record(local, compute);
      const auto p0 = Clock::now();
      replanned = planner_->endStep();
      if (planner_->lastExchangeSeconds() > 0) {
        timeline_.add("plan exchange", p0, Clock::now(), step_, 1);
      }
      if (replanned) {
        loader_->setPlan(planner_->plan());
      }
    }
    const double lossValue = local > 0 ? loss.detach().to(at::kDouble).item<double>() : 0.0;
    epochLossSum_ += lossValue * static_cast<double>(local);
    epochSamples_ += local;
    const double stepSeconds = seconds(t0, tEnd) + extra + batch.waitSeconds;
    const double samplesPerSecond = stepSeconds > 0 ? global / stepSeconds : 0.0;
    ++step_;

    nlohmann::json record{{"kind", "step"},
                          {"rank", comm_.rank()},
                          {"epoch", epoch_},
                          {"step", step_},
                          {"local_batch", local},
                          {"global_batch", global},
                          {"share", global > 0 ? static_cast<double>(local) / global : 0.0},
                          {"samples_per_s", samplesPerSecond},
                          {"data_wait_s", batch.waitSeconds},
                          {"compute_s", compute},
                          {"comm_wait_s", stats.waitSeconds},
                          {"step_s", stepSeconds},
                          {"loss", lossValue},
                          {"loss_scale", scaler_->isEnabled() ? scaler_->currentScale() : 1.0},
                          {"stepped", stepped},
                          {"plan", batch.share.plan.local}};
    if (replanned) {
      record["new_plan"] = planner_->plan().local;
    }
    if (planner_ && planner_->lastExchangeSeconds() > 0) {
      record["plan_exchange_s"] = planner_->lastExchangeSeconds();
    }
    metrics_.write(record);
    std::ostringstream extraText;
    extraText << "  share " << local << "/" << global;
    if (batch.waitSeconds > 0.05 * stepSeconds && stepSeconds > 0) {
      extraText << "  data wait " << static_cast<int>(100 * batch.waitSeconds / stepSeconds) << "%";
    }
    progress_->step(epoch_, options_.epochs, batch.stepInEpoch, info.stepsPerEpoch, lossValue,
                    samplesPerSecond, extraText.str());
    return true;
  }

  // Some rank ran out of memory in this step (every rank gets here, after the step's
  // collectives): learn the failing ranks' memory caps, re-plan, and rewind the loader
  // so the same global batch is served again under the new split. Nothing was applied
  // (no optimizer step), so no sample is lost or counted twice.
  void recoverFromOutOfMemory(const Batch& batch, const std::string& mine, Clock::time_point t0) {
    const int64_t local = batch.share.localBatch;
    int64_t info[2] = {mine.empty() ? 0 : 1, local};
    std::vector<uint8_t> bytes(sizeof(info));
    std::memcpy(bytes.data(), info, sizeof(info));
    const auto all = comm_.allgatherBytes(bytes);
    std::vector<std::pair<int, int64_t>> failures;
    for (size_t r = 0; r < all.size(); ++r) {
      int64_t theirs[2];
      HDDP_INTERNAL_ASSERT(all[r].size() == sizeof(theirs), "bad failure report from rank ", r);
      std::memcpy(theirs, all[r].data(), sizeof(theirs));
      if (theirs[0] != 0) {
        failures.emplace_back(static_cast<int>(r), theirs[1]);
      }
    }
    HDDP_INTERNAL_ASSERT(!failures.empty(), "a step was abandoned but no rank reports a failure");
    const BatchPlan before = currentPlan();
    for (const auto& [r, b] : failures) {
      HDDP_CHECK(planner_ != nullptr, "rank ", r, " ran out of memory with its equal share of ", b,
                 " samples (balancing is off). Lower the global batch, use mixed precision or "
                 "activation checkpointing, or turn balancing on so the planner gives that rank "
                 "fewer samples.");
      const int64_t floorShare = std::max<int64_t>(1, options_.planner.minLocalBatch);
      HDDP_CHECK(b > floorShare, "rank ", r, " ran out of memory with ", b,
                 " sample(s) in its step: the model does not fit on that device even at the "
                 "smallest share. Use mixed precision or activation checkpointing, or leave the "
                 "device out.");
      // 10% below the failing size (at least one sample): a few retries at most find a
      // size that fits, and fragmentation gets some room.
      const int64_t cap = std::max(floorShare, b - std::max<int64_t>(1, b / 10));
      planner_->setMemoryCap(r, cap);
    }
    ++repeatedSteps_;
    std::ostringstream who;
    for (const auto& [r, b] : failures) {
      who << (who.tellp() > 0 ? ", " : "") << "rank " << r << " at " << b << " samples";
    }
    const BatchPlan after = currentPlan();
    // Rank 0 and the failing ranks warn; the others note it.
    const std::string message = c10::str(
        "step ", step_ + 1, ": out of memory on ", who.str(),
        mine.empty() ? std::string() : " (" + firstLine(mine) + ")", "; memory cap learned, split ",
        before.describe(), " -> ", after.describe(), "; the step is repeated");
    if (comm_.rank() == 0 || !mine.empty()) {
      HDDP_LOG_WARN("train", message);
    } else {
      HDDP_LOG_INFO("train", message);
    }
    nlohmann::json record{{"kind", "out_of_memory"}, {"rank", comm_.rank()},
                          {"epoch", epoch_},         {"step", step_ + 1},
                          {"plan", before.local},    {"new_plan", after.local}};
    nlohmann::json failed = nlohmann::json::array();
    for (const auto& [r, b] : failures) {
      failed.push_back({{"rank", r}, {"local_batch", b}});
    }
    record["failed"] = failed;
    metrics_.write(record);
    timeline_.add("out of memory, step repeated", t0, Clock::now(), step_);
    DistributedSampler::State state = loader_->state();
    state.position -= batch.share.globalBatch;
    HDDP_INTERNAL_ASSERT(state.position >= 0, "rewinding the sampler before the epoch start");
    loader_->resume(state, after);
  }

  static std::string firstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

  void endEpoch(Clock::time_point epochStart, int64_t epochSteps, TrainSummary& summary) {
    // The epoch's mean training loss over every rank's samples.
    at::Tensor sums =
        at::tensor({epochLossSum_, static_cast<double>(epochSamples_)}, at::kDouble).to(device_);
    comm_.allreduce(sums).wait();
    sums = sums.cpu();
    const double totalSamples = sums[1].item<double>();
    lastEpochLoss_ = totalSamples > 0 ? sums[0].item<double>() / totalSamples : 0.0;
    const double epochSeconds = seconds(epochStart, Clock::now());
    std::map<std::string, double> evaluation;
    if (evaluation_) {
      const auto e0 = Clock::now();
      evaluation = evaluation_(epoch_);
      timeline_.add("evaluation", e0, Clock::now(), step_);
      model_->train();
    }
    if (!evaluation.empty()) {  // an epoch without evaluation keeps the last one
      lastEvaluation_ = evaluation;
    }
    ++summary.epochsCompleted;
    nlohmann::json record{{"kind", "epoch"},
                          {"rank", comm_.rank()},
                          {"epoch", epoch_},
                          {"steps", epochSteps},
                          {"seconds", epochSeconds},
                          {"samples_per_s", epochSeconds > 0 ? totalSamples / epochSeconds : 0.0},
                          {"train_loss", lastEpochLoss_},
                          {"plan", currentPlan().local}};
    for (const auto& [k, v] : evaluation) {
      record[k] = v;
    }
    metrics_.write(record);
    std::ostringstream line;
    line.precision(4);
    line << "epoch " << epoch_ + 1 << "/" << options_.epochs << ": train loss " << lastEpochLoss_;
    for (const auto& [k, v] : evaluation) {
      line << ", " << k << " " << v;
    }
    line.precision(3);
    line << " (" << epochSeconds << " s, split " << currentPlan().describe() << ")";
    progress_->line(line.str());
  }

  void barrier() {
    at::Tensor t = at::zeros({1}, at::TensorOptions().device(device_));
    comm_.allreduce(t).wait();
  }

  // ---- state ---------------------------------------------------------------------------

  // This rank's own part of the state: RNGs and the planner's measurement window.
  std::string rankBlob() {
    torch::serialize::OutputArchive a;
    a.write("cpu_rng", generatorState(at::detail::getDefaultCPUGenerator()));
    if (device_.type() != c10::kCPU) {
      a.write("device_rng", generatorState(at::globalContext().defaultGenerator(device_)));
    }
    if (planner_) {
      const auto window = planner_->state().window;
      a.write("planner_window",
              at::tensor(window.empty() ? std::vector<double>{} : window, at::kDouble));
    }
    return archiveBytes(a);
  }

  std::string save() {
    HDDP_CHECK_AS(ConfigError, !options_.saveDir.empty(),
                  "Trainer::save() needs TrainerOptions::saveDir");
    const auto t0 = Clock::now();
    const std::string blob = rankBlob();
    const auto blobs = comm_.allgatherBytes(std::vector<uint8_t>(blob.begin(), blob.end()));
    const std::string path = stateFileName(options_.saveDir, step_);
    if (comm_.rank() == 0) {
      torch::serialize::OutputArchive archive;
      // Flat, by name: loading copies into the parameters (Module::load would replace
      // them, which detaches DDP's gradient hooks).
      for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
        archive.write("model." + item.key(), item.value().detach().cpu());
      }
      for (const auto& item : model_->named_buffers(/*recurse=*/true)) {
        archive.write("buffer." + item.key(), item.value().detach().cpu());
      }
      torch::serialize::OutputArchive optimizerArchive;
      optimizer_.save(optimizerArchive);
      archive.write("optimizer", optimizerArchive);
      torch::serialize::OutputArchive scalerArchive;
      scaler_->save(scalerArchive);
      archive.write("scaler", scalerArchive);
      const DistributedSampler::State sampler =
          midEpoch_ ? samplerState_ : DistributedSampler::State{epoch_, 0};
      const BatchPlan plan = currentPlan();
      archive.write(
          "meta",
          at::tensor(std::vector<int64_t>{kStateVersion, step_, epoch_, sampler.epoch,
                                          sampler.position, comm_.size(), options_.globalBatch,
                                          planner_ ? planner_->step() : 0, midEpoch_ ? 1 : 0},
                     at::kLong));
      archive.write("plan", at::tensor(plan.local, at::kLong));
      if (planner_) {
        std::vector<double> costs;
        for (const auto& c : planner_->costs()) {
          costs.push_back(c.secondsPerSample);
        }
        archive.write("planner_costs",
                      at::tensor(costs.empty() ? std::vector<double>{} : costs, at::kDouble));
        // Memory caps (learned from out-of-memory steps or given); -1 = none.
        std::vector<int64_t> caps;
        for (int64_t cap : planner_->memoryCaps()) {
          caps.push_back(cap == std::numeric_limits<int64_t>::max() ? -1 : cap);
        }
        archive.write("planner_caps", at::tensor(caps, at::kLong));
      }
      for (size_t r = 0; r < blobs.size(); ++r) {
        archive.write("rank" + std::to_string(r),
                      bytesTensor(std::string(blobs[r].begin(), blobs[r].end())));
      }
      writeStateFile(path, archiveBytes(archive));
      pruneStateFiles(options_.saveDir, options_.keepLast);
      HDDP_LOG_INFO("train", "saved step ", step_, " to ", path);
    }
    timeline_.add("save", t0, Clock::now(), step_);
    return path;
  }

  // Rank 0 chooses the file (the newest valid one of a directory) and tells the others.
  std::string chooseStateFile(const std::string& fileOrDirectory) {
    std::string chosen;
    std::string problem;
    if (comm_.rank() == 0) {
      if (std::filesystem::is_directory(fileOrDirectory)) {
        auto files = listStateFiles(fileOrDirectory);
        for (auto it = files.rbegin(); it != files.rend() && chosen.empty(); ++it) {
          try {
            readStateFile(*it);
            chosen = *it;
          } catch (const StateError& e) {
            HDDP_LOG_WARN("train", "skipping ", *it, ": ", e.what_without_backtrace());
          }
        }
        if (chosen.empty()) {
          problem = "no valid state file (state-NNNNNNNN.hddp) in " + fileOrDirectory;
        }
      } else {
        chosen = fileOrDirectory;
      }
    }
    const std::string mine = problem.empty() ? chosen : "!" + problem;
    const auto all = comm_.allgatherBytes(std::vector<uint8_t>(mine.begin(), mine.end()));
    const std::string decided(all[0].begin(), all[0].end());
    HDDP_CHECK_AS(StateError, decided.empty() || decided[0] != '!',
                  "cannot resume: ", decided.substr(decided.empty() ? 0 : 1));
    return decided;
  }

  void load(const std::string& fileOrDirectory) {
    const std::string path = chooseStateFile(fileOrDirectory);
    std::string payload;
    try {
      payload = readStateFile(path);
    } catch (const StateError&) {
      if (comm_.rank() != 0) {
        HDDP_LOG_ERROR("train", "rank ", comm_.rank(), " cannot read ", path,
                       ": the state directory must be visible to every rank");
      }
      throw;
    }
    torch::serialize::InputArchive archive;
    archive.load_from(payload.data(), payload.size());
    const at::Tensor meta = readTensor(archive, "meta", path);
    HDDP_CHECK_AS(StateError, meta.numel() == 9 && meta[0].item<int64_t>() == kStateVersion,
                  "state file ", path, " has format version ", meta[0].item<int64_t>(),
                  ", this hddp reads version ", kStateVersion);
    auto m = [&](int i) { return meta[i].item<int64_t>(); };
    HDDP_CHECK_AS(StateError, m(5) == comm_.size(), "state file ", path, " was saved by ", m(5),
                  " ranks; this job has ", comm_.size(), ". Resume with the same number of ranks.");
    HDDP_CHECK_AS(StateError, m(6) == options_.globalBatch, "state file ", path,
                  " was saved with global batch ", m(6), "; this job uses ", options_.globalBatch,
                  ". Resume with the same global batch.");
    try {
      torch::NoGradGuard noGrad;
      auto copyInto = [&](const std::string& key, at::Tensor target) {
        at::Tensor saved;
        HDDP_CHECK_AS(StateError, archive.try_read(key, saved), "state file ", path, " has no '",
                      key, "': it was saved from a different model");
        HDDP_CHECK_AS(StateError, saved.sizes() == target.sizes(), "state file ", path, ": '", key,
                      "' has shape ", saved.sizes(), ", the model's is ", target.sizes());
        target.copy_(saved);
      };
      for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
        copyInto("model." + item.key(), item.value());
      }
      for (const auto& item : model_->named_buffers(/*recurse=*/true)) {
        copyInto("buffer." + item.key(), item.value());
      }
      torch::serialize::InputArchive optimizerArchive;
      HDDP_CHECK_AS(StateError, archive.try_read("optimizer", optimizerArchive), "state file ",
                    path, " has no optimizer state");
      optimizer_.load(optimizerArchive);
      torch::serialize::InputArchive scalerArchive;
      HDDP_CHECK_AS(StateError, archive.try_read("scaler", scalerArchive), "state file ", path,
                    " has no scaler state");
      scaler_->load(scalerArchive);
    } catch (const StateError&) {
      throw;
    } catch (const c10::Error& e) {
      HDDP_THROW(StateError, "state file ", path,
                 " does not fit this model or optimizer: ", e.what_without_backtrace());
    }
    step_ = m(1);
    epoch_ = m(2);
    samplerState_ = DistributedSampler::State{m(3), m(4)};
    midEpoch_ = m(8) != 0;
    // This rank's RNGs and measurements.
    const at::Tensor blob = readTensor(archive, "rank" + std::to_string(comm_.rank()), path);
    const std::string blobBytes = tensorBytes(blob);
    torch::serialize::InputArchive mine;
    mine.load_from(blobBytes.data(), blobBytes.size());
    setGeneratorState(at::detail::getDefaultCPUGenerator(), readTensor(mine, "cpu_rng", path));
    at::Tensor deviceRng;
    if (device_.type() != c10::kCPU && mine.try_read("device_rng", deviceRng)) {
      setGeneratorState(at::globalContext().defaultGenerator(device_), deviceRng);
    }
    if (planner_) {
      BatchPlanner::State state;
      const at::Tensor plan = readTensor(archive, "plan", path);
      state.plan.local.assign(plan.data_ptr<int64_t>(), plan.data_ptr<int64_t>() + plan.numel());
      state.plan.global = options_.globalBatch;
      state.step = m(7);
      at::Tensor window;
      if (mine.try_read("planner_window", window) && window.numel() > 0) {
        window = window.contiguous();
        state.window.assign(window.data_ptr<double>(), window.data_ptr<double>() + window.numel());
      }
      at::Tensor costs;
      if (archive.try_read("planner_costs", costs) && costs.numel() > 0) {
        for (int64_t i = 0; i < costs.numel(); ++i) {
          RankCost c;
          c.secondsPerSample = costs[i].item<double>();
          state.costs.push_back(c);
        }
      }
      at::Tensor caps;
      if (archive.try_read("planner_caps", caps) && caps.numel() == comm_.size()) {
        state.costs.resize(static_cast<size_t>(comm_.size()));
        for (int64_t i = 0; i < caps.numel(); ++i) {
          const int64_t cap = caps[i].item<int64_t>();
          if (cap >= 0) {
            state.costs[static_cast<size_t>(i)].maxSamples = cap;
          }
        }
      }
      planner_->restore(state);
    }
    resumed_ = true;
    HDDP_LOG_INFO("train", "resumed from ", path, " at step ", step_, ", epoch ", epoch_,
                  midEpoch_ ? " (mid-epoch, sample " + std::to_string(samplerState_.position) + ")"
                            : std::string());
  }

  Communicator& comm_;
  std::shared_ptr<torch::nn::Module> model_;
  ForwardFn forward_;
  LossFn loss_;
  torch::optim::Optimizer& optimizer_;
  TrainerOptions options_;
  c10::Device device_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<BatchPlanner> planner_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<PrefetchLoader> loader_;
  std::unique_ptr<Emulator> emulator_;
  bool hasSyncBatchNorm_ = false;
  int64_t repeatedSteps_ = 0;
  ScheduleFn schedule_;
  EvalFn evaluation_;
  Timeline timeline_;
  train::MetricsWriter metrics_;
  std::unique_ptr<train::Progress> progress_;

  int64_t step_ = 0;
  int64_t epoch_ = 0;
  bool midEpoch_ = false;
  bool resumed_ = false;
  int64_t lastSaved_ = -1;
  DistributedSampler::State samplerState_;
  double perSample_ = 0;
  double epochLossSum_ = 0;
  int64_t epochSamples_ = 0;
  double lastEpochLoss_ = 0;
  std::map<std::string, double> lastEvaluation_;
};

Trainer::Trainer(Communicator& communicator, std::shared_ptr<torch::nn::Module> model,
                 ForwardFn forward, LossFn loss, torch::optim::Optimizer& optimizer,
                 std::shared_ptr<const Dataset> train, TrainerOptions options)
    : impl_(std::make_unique<Impl>(communicator, std::move(model), std::move(forward),
                                   std::move(loss), optimizer, std::move(train),
                                   std::move(options))) {}
Trainer::~Trainer() = default;
void Trainer::setSchedule(ScheduleFn schedule) { impl_->schedule_ = std::move(schedule); }
void Trainer::setEvaluation(EvalFn evaluation) { impl_->evaluation_ = std::move(evaluation); }
TrainSummary Trainer::fit() { return impl_->fit(); }
std::string Trainer::save() { return impl_->save(); }
void Trainer::load(const std::string& fileOrDirectory) { impl_->load(fileOrDirectory); }
int64_t Trainer::step() const { return impl_->step_; }
int64_t Trainer::epoch() const { return impl_->epoch_; }
DistributedDataParallel& Trainer::ddp() { return *impl_->ddp_; }
BatchPlanner* Trainer::planner() { return impl_->planner_.get(); }
GradScaler& Trainer::scaler() { return *impl_->scaler_; }
PrefetchLoader& Trainer::loader() { return *impl_->loader_; }
const TrainerOptions& Trainer::options() const { return impl_->options_; }

}  // namespace hddp
