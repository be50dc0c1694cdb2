// What the Trainer reports (internal to the train layer): one JSON line per step,
// epoch, evaluation, repeated step and run in the rank's metrics file, rank 0's
// progress bar or lines, and rank 0's TensorBoard events. Every record kind is written
// here and nowhere else.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hddp/train/tensorboard.h"
#include "train/memory_meter.h"
#include "train/metrics.h"

namespace hddp {

struct OutOfMemoryOutcome;
struct TrainSummary;

namespace train {

struct StepReport {
  int64_t epoch = 0;
  int64_t epochs = 0;
  int64_t step = 0;  // steps done, this one included
  int64_t stepInEpoch = 0;
  int64_t stepsPerEpoch = 0;
  int64_t maxSteps = 0;  // the run's TrainerOptions::maxSteps (0: none); the progress honours it
  int64_t localBatch = 0;
  int64_t globalBatch = 0;
  double dataWaitSeconds = 0;
  double computeSeconds = 0;  // emulated stretch included
  double commWaitSeconds = 0;
  double predictedAllreduceSeconds = 0;  // 0: not predicted (no link known)
  double transferSeconds = 0;            // input copy (device events) or emulated link
  double emulatedSeconds = 0;            // the emulator's sleep (part of computeSeconds)
  double stepSeconds = 0;
  double loss = 0;
  double lossScale = 1;
  double learningRate = -1;  // the optimizer's first parameter group's (-1: not known)
  bool stepped = true;
  std::vector<int64_t> plan;
  std::vector<int64_t> newPlan;  // empty: the plan did not change
  double planExchangeSeconds = 0;
  MemoryReading memory;              // valid: measured
  int64_t memoryCap = -1;            // this rank's cap in the plan (-1: none)
  int64_t optimizerStateBytes = -1;  // this rank's optimizer state (-1: not known)
};

struct EpochReport {
  int64_t epoch = 0;
  int64_t epochs = 0;
  int64_t steps = 0;
  int64_t step = 0;  // global steps done at the epoch's end
  double seconds = 0;
  double samples = 0;  // over all ranks
  double trainLoss = 0;
  std::vector<int64_t> plan;
  std::string planText;
  std::map<std::string, double> evaluation;  // empty: not evaluated
  double peakMemoryBytes = 0;                // MemoryReading::peak() over the epoch
};

class Reporter {
 public:
  Reporter() = default;
  /// Opens this rank's metrics file (`metricsPath` with ".rank<r>" for r > 0; "" = none),
  /// appending when `append`; progress is shown on rank 0 unless `showProgress` is false,
  /// as a live bar when `live`, else as lines every `logEvery` steps.
  Reporter(const std::string& metricsPath, int rank, bool append, bool showProgress, bool live,
           int64_t logEvery);

  /// The run's configuration, first in the file (each fit(), a resumed one too).
  void config(const nlohmann::json& config);
  /// Rank 0 opens a TensorBoard event file in `dir` ("" = none) for this fit(), whose
  /// first step is `firstStep` (TensorBoard drops what earlier files hold from there on).
  /// Throws on rank 0 when it cannot (hddp::ConfigError for a folder or file it cannot
  /// make): the caller tells the other ranks. Once open, a write that fails (a full
  /// disk) throws nowhere: it is logged as an error and TensorBoard output stops for
  /// the rest of the run, while training and the metrics lines go on (rank 0 alone
  /// writes TensorBoard, and must not leave fit() while the others wait in a collective).
  void startTensorBoard(const std::string& dir, int64_t firstStep);
  void step(const StepReport& report);
  void epoch(const EpochReport& report);
  /// An evaluation outside an epoch's end (maxSteps stopped the run inside one).
  void evaluationAtStop(int64_t epoch, int64_t step, const std::map<std::string, double>& metrics,
                        const std::string& planText, const std::string& stoppedBy);
  void outOfMemory(const OutOfMemoryOutcome& recovery, int64_t epoch, int64_t step);
  void summary(const TrainSummary& summary, const std::map<std::string, double>& evaluation);

 private:
  void tensorBoardStep(TensorBoardWriter& tb, const StepReport& r, double samplesPerSecond);
  // Runs `write` with the open TensorBoard writer (none open: nothing); a failure is
  // logged and closes TensorBoard for the rest of the run (startTensorBoard).
  void writeTensorBoard(const std::function<void(TensorBoardWriter&)>& write);

  int rank_ = 0;
  MetricsWriter metrics_;
  std::unique_ptr<Progress> progress_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 with a TensorBoard folder
  bool planShown_ = false;                          // the first step's split is in TensorBoard
};

}  // namespace train
}  // namespace hddp
