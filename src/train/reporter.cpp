#include "train/reporter.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "hddp/balance/batch_plan.h"
#include "hddp/core/logging.h"
#include "hddp/train/out_of_memory.h"
#include "hddp/train/trainer.h"

namespace hddp {
namespace train {
namespace {

std::string describePlan(const std::vector<int64_t>& local, int64_t global) {
  BatchPlan plan;
  plan.local = local;
  plan.global = global;
  return plan.describe();
}

// The progress's epoch count and the steps of this epoch, with maxSteps ending the run
// early: {epochs, stepsPerEpoch} when it does not.
std::pair<int64_t, int64_t> progressTotals(const StepReport& r) {
  if (r.maxSteps <= 0 || r.stepsPerEpoch <= 0) {
    return {r.epochs, r.stepsPerEpoch};
  }
  const int64_t epochStart = r.step - (r.stepInEpoch + 1);  // global steps before this epoch
  const int64_t inEpoch = std::clamp<int64_t>(r.maxSteps - epochStart, r.stepInEpoch + 1,
                                              std::max(r.stepsPerEpoch, r.stepInEpoch + 1));
  // The epoch the run ends in (0-based), counted from this one.
  const int64_t stepsAfter = std::max<int64_t>(0, r.maxSteps - epochStart - r.stepsPerEpoch);
  const int64_t lastEpoch = r.epoch + (stepsAfter + r.stepsPerEpoch - 1) / r.stepsPerEpoch;
  return {std::min(r.epochs, lastEpoch + 1), std::min(r.stepsPerEpoch, inEpoch)};
}

}  // namespace

Reporter::Reporter(const std::string& metricsPath, int rank, bool append, bool showProgress,
                   bool live, int64_t logEvery)
    : rank_(rank),
      metrics_(metricsPathForRank(metricsPath, rank), append),
      progress_(std::make_unique<Progress>(rank == 0 && showProgress, live, logEvery)) {}

void Reporter::config(const nlohmann::json& config) {
  nlohmann::json record{{"kind", "config"}, {"rank", rank_}};
  record.update(config);
  metrics_.write(record);
}

void Reporter::startTensorBoard(const std::string& dir, int64_t firstStep) {
  if (rank_ != 0 || dir.empty()) {
    return;
  }
  tensorboard_.reset();
  auto tb = std::make_unique<TensorBoardWriter>(dir);
  tb->markStart(firstStep);
  tb->flush();
  tensorboard_ = std::move(tb);
  planShown_ = false;
  HDDP_LOG_INFO("train", "TensorBoard events in ", tensorboard_->path(),
                " (watch with: tensorboard --logdir ", dir, ")");
}

void Reporter::writeTensorBoard(const std::function<void(TensorBoardWriter&)>& write) {
  if (!tensorboard_) {
    return;
  }
  std::string why;
  try {
    write(*tensorboard_);
    return;
  } catch (const c10::Error& e) {
    why = e.what_without_backtrace();
  } catch (const std::exception& e) {
    why = e.what();
  }
  HDDP_LOG_ERROR("train", "TENSORBOARD OUTPUT STOPS HERE: ", why,
                 ". This run writes nothing more to ", tensorboard_->path(),
                 "; training goes on, and so do the metrics lines (TrainerOptions::metricsPath, "
                 "--metrics)");
  tensorboard_.reset();
}

// Rank 0's view of the step: the loss of its share (none when it had no samples), the
// global throughput, every rank's
// share of the batch, its own step-time parts and memory; the split as text when the run
// starts and whenever it changes.
void Reporter::tensorBoardStep(TensorBoardWriter& tb, const StepReport& r,
                               double samplesPerSecond) {
  const int64_t s = r.step;
  if (r.localBatch > 0) {  // a share without samples has no loss (not a loss of 0)
    tb.addScalar("train/loss", r.loss, s);
  }
  tb.addScalar("train/samples_per_s", samplesPerSecond, s);
  if (r.learningRate >= 0) {
    tb.addScalar("train/lr", r.learningRate, s);
  }
  for (size_t i = 0; i < r.plan.size(); ++i) {
    tb.addScalar("share/rank" + std::to_string(i),
                 r.globalBatch > 0 ? static_cast<double>(r.plan[i]) / r.globalBatch : 0.0, s);
  }
  tb.addScalar("time/step_s", r.stepSeconds, s);
  tb.addScalar("time/data_wait_s", r.dataWaitSeconds, s);
  tb.addScalar("time/compute_s", r.computeSeconds, s);
  tb.addScalar("time/comm_wait_s", r.commWaitSeconds, s);
  if (r.transferSeconds > 0) {
    tb.addScalar("time/transfer_s", r.transferSeconds, s);
  }
  if (r.emulatedSeconds > 0) {
    tb.addScalar("time/emulated_s", r.emulatedSeconds, s);
  }
  if (r.predictedAllreduceSeconds > 0) {
    tb.addScalar("time/allreduce_predicted_s", r.predictedAllreduceSeconds, s);
  }
  if (r.planExchangeSeconds > 0) {
    tb.addScalar("time/plan_exchange_s", r.planExchangeSeconds, s);
  }
  if (r.memory.valid) {
    if (r.memory.device) {
      tb.addScalar("memory/rank0_peak_allocated_bytes", r.memory.peakBytes, s);
      tb.addScalar("memory/rank0_peak_reserved_bytes", r.memory.reservedPeakBytes, s);
    } else {
      tb.addScalar("memory/rank0_resident_bytes", r.memory.residentBytes, s);
    }
  }
  if (r.optimizerStateBytes >= 0) {
    tb.addScalar("memory/rank0_optimizer_state_bytes", r.optimizerStateBytes, s);
  }
  if (!planShown_) {
    tb.addText("plan", "step " + std::to_string(s) + ": " + describePlan(r.plan, r.globalBatch), s);
    planShown_ = true;
  }
  if (!r.newPlan.empty()) {
    tb.addText("plan",
               "from step " + std::to_string(s + 1) + ": " +
                   describePlan(r.newPlan, r.globalBatch) + " (was " +
                   describePlan(r.plan, r.globalBatch) + ")",
               s);
  }
  tb.flush();
}

void Reporter::step(const StepReport& r) {
  const double share = r.globalBatch > 0 ? static_cast<double>(r.localBatch) / r.globalBatch : 0.0;
  const double samplesPerSecond = r.stepSeconds > 0 ? r.globalBatch / r.stepSeconds : 0.0;
  nlohmann::json record{{"kind", "step"},
                        {"rank", rank_},
                        {"epoch", r.epoch},
                        {"step", r.step},
                        {"local_batch", r.localBatch},
                        {"global_batch", r.globalBatch},
                        {"share", share},
                        {"samples_per_s", samplesPerSecond},
                        {"data_wait_s", r.dataWaitSeconds},
                        {"compute_s", r.computeSeconds},
                        {"comm_wait_s", r.commWaitSeconds},
                        {"step_s", r.stepSeconds},
                        {"loss", r.loss},
                        {"loss_scale", r.lossScale},
                        {"stepped", r.stepped},
                        {"plan", r.plan}};
  if (r.transferSeconds > 0) {
    record["transfer_s"] = r.transferSeconds;
  }
  if (r.emulatedSeconds > 0) {
    record["emulated_s"] = r.emulatedSeconds;
  }
  if (r.predictedAllreduceSeconds > 0) {
    record["allreduce_predicted_s"] = r.predictedAllreduceSeconds;
  }
  if (!r.newPlan.empty()) {
    record["new_plan"] = r.newPlan;
  }
  if (r.planExchangeSeconds > 0) {
    record["plan_exchange_s"] = r.planExchangeSeconds;
  }
  if (r.memory.valid) {
    nlohmann::json memory;
    if (r.memory.device) {
      memory = {{"peak_allocated_bytes", r.memory.peakBytes},
                {"peak_reserved_bytes", r.memory.reservedPeakBytes},
                {"base_bytes", r.memory.baseBytes},
                {"total_bytes", r.memory.totalBytes}};
      if (r.memory.otherBytes > 0) {
        memory["other_bytes"] = r.memory.otherBytes;
      }
    } else {
      memory = {{"resident_bytes", r.memory.residentBytes}};
    }
    if (r.memory.emulated) {
      memory["emulated"] = true;
    }
    if (r.memoryCap >= 0) {
      memory["cap_samples"] = r.memoryCap;
    }
    record["memory"] = memory;
  }
  if (r.optimizerStateBytes >= 0) {
    record["optimizer_state_bytes"] = r.optimizerStateBytes;
  }
  metrics_.write(record);
  writeTensorBoard([&](TensorBoardWriter& tb) { tensorBoardStep(tb, r, samplesPerSecond); });
  std::ostringstream extra;
  extra << "  share " << r.localBatch << "/" << r.globalBatch;
  if (r.dataWaitSeconds > 0.05 * r.stepSeconds && r.stepSeconds > 0) {
    extra << "  data wait " << static_cast<int>(100 * r.dataWaitSeconds / r.stepSeconds) << "%";
  }
  const auto [epochs, stepsThisEpoch] = progressTotals(r);
  progress_->step(r.epoch, epochs, r.stepInEpoch, stepsThisEpoch, r.loss, samplesPerSecond,
                  extra.str());
}

void Reporter::epoch(const EpochReport& r) {
  nlohmann::json record{
      {"kind", "epoch"},           {"rank", rank_},
      {"epoch", r.epoch},          {"steps", r.steps},
      {"seconds", r.seconds},      {"samples_per_s", r.seconds > 0 ? r.samples / r.seconds : 0.0},
      {"train_loss", r.trainLoss}, {"plan", r.plan}};
  if (r.peakMemoryBytes > 0) {
    record["peak_memory_bytes"] = r.peakMemoryBytes;
  }
  for (const auto& [k, v] : r.evaluation) {
    record[k] = v;
  }
  metrics_.write(record);
  writeTensorBoard([&](TensorBoardWriter& tb) {
    tb.addScalar("epoch/epoch", static_cast<double>(r.epoch + 1), r.step);
    tb.addScalar("epoch/train_loss", r.trainLoss, r.step);
    tb.addScalar("epoch/samples_per_s", r.seconds > 0 ? r.samples / r.seconds : 0.0, r.step);
    if (r.peakMemoryBytes > 0) {
      tb.addScalar("memory/rank0_epoch_peak_bytes", r.peakMemoryBytes, r.step);
    }
    for (const auto& [k, v] : r.evaluation) {
      tb.addScalar("eval/" + k, v, r.step);
    }
    tb.flush();
  });
  std::ostringstream line;
  line.precision(4);
  line << "epoch " << r.epoch + 1 << "/" << r.epochs << ": train loss " << r.trainLoss;
  for (const auto& [k, v] : r.evaluation) {
    line << ", " << k << " " << v;
  }
  line.precision(3);
  line << " (" << r.seconds << " s, split " << r.planText << ")";
  progress_->line(line.str());
}

void Reporter::evaluationAtStop(int64_t epoch, int64_t step,
                                const std::map<std::string, double>& metrics,
                                const std::string& planText, const std::string& stoppedBy) {
  nlohmann::json record{{"kind", "evaluation"}, {"rank", rank_}, {"epoch", epoch}, {"step", step}};
  std::ostringstream line;
  line.precision(4);
  line << "step " << step << " (epoch " << epoch + 1 << ", stopped by " << stoppedBy << "):";
  const char* sep = " ";
  for (const auto& [k, v] : metrics) {
    record[k] = v;
    line << sep << k << " " << v;
    sep = ", ";
  }
  line << " (split " << planText << ")";
  metrics_.write(record);
  writeTensorBoard([&](TensorBoardWriter& tb) {
    for (const auto& [k, v] : metrics) {
      tb.addScalar("eval/" + k, v, step);
    }
    tb.flush();
  });
  progress_->line(line.str());
}

void Reporter::outOfMemory(const OutOfMemoryOutcome& recovery, int64_t epoch, int64_t step) {
  nlohmann::json record{{"kind", "out_of_memory"},
                        {"rank", rank_},
                        {"epoch", epoch},
                        {"step", step},
                        {"plan", recovery.before.local},
                        {"new_plan", recovery.after.local}};
  nlohmann::json failed = nlohmann::json::array();
  for (const auto& f : recovery.failures) {
    failed.push_back({{"rank", f.rank}, {"local_batch", f.localBatch}});
  }
  record["failed"] = failed;
  metrics_.write(record);
  writeTensorBoard([&](TensorBoardWriter& tb) {
    tb.addText("plan", recovery.message, step);
    tb.flush();
  });
}

void Reporter::summary(const TrainSummary& s, const std::map<std::string, double>& evaluation) {
  nlohmann::json record{{"kind", "summary"},
                        {"rank", rank_},
                        {"steps", s.steps},
                        {"total_steps", s.totalSteps},
                        {"epochs_completed", s.epochsCompleted},
                        {"seconds", s.seconds},
                        {"samples_per_s", s.samplesPerSecond},
                        {"repeated_steps", s.repeatedSteps}};
  // The last complete epoch's mean loss; null when no epoch completed (maxSteps or the
  // time budget ended the run inside its first one), not a loss of 0.
  record["train_loss"] = s.epochsCompleted > 0 ? nlohmann::json(s.lastTrainLoss) : nullptr;
  if (s.peakMemoryBytes > 0) {
    record["peak_memory_bytes"] = s.peakMemoryBytes;
  }
  for (const auto& [k, v] : evaluation) {
    record[k] = v;
  }
  metrics_.write(record);
  writeTensorBoard([](TensorBoardWriter& tb) { tb.flush(); });
  std::ostringstream line;
  if (s.totalSteps != s.steps) {
    // A resumed run or a later generation of an elastic job: the job's step, and apart
    // what this run trained.
    line << "done: step " << s.totalSteps << " of the job; this run trained " << s.steps
         << " steps in " << s.seconds << " s (" << static_cast<int64_t>(s.samplesPerSecond)
         << " samples/s)";
  } else {
    line << "done: " << s.steps << " steps in " << s.seconds << " s ("
         << static_cast<int64_t>(s.samplesPerSecond) << " samples/s)";
  }
  progress_->line(line.str());
}

}  // namespace train
}  // namespace hddp
