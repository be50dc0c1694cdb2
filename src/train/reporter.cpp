#include "train/reporter.h"

#include <sstream>

#include "hddp/train/trainer.h"
#include "train/out_of_memory.h"

namespace hddp {
namespace train {

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
  std::ostringstream extra;
  extra << "  share " << r.localBatch << "/" << r.globalBatch;
  if (r.dataWaitSeconds > 0.05 * r.stepSeconds && r.stepSeconds > 0) {
    extra << "  data wait " << static_cast<int>(100 * r.dataWaitSeconds / r.stepSeconds) << "%";
  }
  progress_->step(r.epoch, r.epochs, r.stepInEpoch, r.stepsPerEpoch, r.loss, samplesPerSecond,
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
  progress_->line(line.str());
}

void Reporter::outOfMemory(const OutOfMemoryRecovery& recovery, int64_t epoch, int64_t step) {
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
}

void Reporter::summary(const TrainSummary& s, const std::map<std::string, double>& evaluation) {
  nlohmann::json record{{"kind", "summary"},
                        {"rank", rank_},
                        {"steps", s.steps},
                        {"total_steps", s.totalSteps},
                        {"epochs_completed", s.epochsCompleted},
                        {"seconds", s.seconds},
                        {"samples_per_s", s.samplesPerSecond},
                        {"train_loss", s.lastTrainLoss},
                        {"repeated_steps", s.repeatedSteps}};
  if (s.peakMemoryBytes > 0) {
    record["peak_memory_bytes"] = s.peakMemoryBytes;
  }
  for (const auto& [k, v] : evaluation) {
    record[k] = v;
  }
  metrics_.write(record);
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
