// What the example trainers (examples/resnet, examples/unet) share: the command-line
// flags that map onto hddp::TrainerOptions, the optimizer and learning-rate schedule,
// sharded evaluation with one allreduce, and error reporting in main().
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hddp/data/dataset.h"
#include "hddp/train/trainer.h"

namespace CLI {
class App;
}  // namespace CLI

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace hddp {
class Communicator;
struct DistributedContext;
struct InitOptions;

namespace examples {

/// The flags every trainer has (see addCommonFlags for their names and help).
struct CommonFlags {
  int64_t globalBatch = 128;
  int64_t epochs = 1;
  int64_t maxSteps = 0;
  double timeBudget = 0.0;  // seconds; 0: no limit
  double lr = 0.1;
  std::string schedule = "cosine";  // cosine | step | constant
  double warmupEpochs = 0.0;
  std::string optimizer = "sgd";  // sgd | adamw
  double momentum = 0.9;
  double weightDecay = 5e-4;
  std::string amp = "off";
  bool checkpointActivations = false;
  int workers = 2;
  int prefetch = 2;
  std::string saveDir;
  int64_t saveEvery = 0;
  std::string resume;
  std::vector<std::string> exportPaths;  // --export: the model's state dict after training
  std::string initFrom;                  // --init-from: a state dict to start from
  std::vector<std::string> initSkip;     // --init-skip: key prefixes left out of it
  bool initAllowIntFloat = false;        // --init-allow-int-float: integer <-> float loads
  int64_t evalEvery = 1;
  int64_t evalBatch = 256;
  int threads = 0;
  std::string metrics;
  std::string timeline;
  std::string tensorboard;
  bool balance = true;  // --no-balance: the equal split
  std::string emulateSlowdown;
  std::string emulateLinkGbps;
  double emulateLinkLatencyUs = 0;
  std::string compress = "none";   // none, fp16, bf16, powersgd[:RANK], auto
  int zero = 0;                    // ZeRO stage: 0, 1, 2
  std::string shardBy = "memory";  // memory, equal, R0:R1:...
  int64_t compressStart = 0;       // 0: 10% of the planned steps
  std::string emulateMemoryCap;
  std::string emulateMemory;
  std::string maxLocalBatch;
  uint64_t seed = 0;
  int64_t limitTrain = 0;
  int64_t limitTest = 0;
  std::string progress = "auto";
  int64_t logEvery = 20;
  double clipGradNorm = 0.0;
  std::string device;  // empty: HDDP_DEVICE, else cuda:<local rank> with CUDA, else cpu
};

/// Registers the common flags on `app`, writing into `flags`.
void addCommonFlags(CLI::App& app, CommonFlags& flags);

/// initFromEnv's options from the flags: --device (a ConfigError names a bad one).
InitOptions initOptions(const CommonFlags& flags);

/// initFromEnv(initOptions(flags)); a rank on emu also tells emu that its device is the
/// only one it computes on, so an allocation on another emu device is reported with
/// where it came from (hddp::emu::setOwnDevice).
DistributedContext initRank(const CommonFlags& flags);

/// Threads per rank: --threads, else the machine's cores divided by the ranks on this
/// host (at least 1). Sets LibTorch's intra-op threads and returns the number.
int applyThreads(const CommonFlags& flags, const DistributedContext& ctx);

/// TrainerOptions from the flags (validated: a bad value throws hddp::ConfigError).
/// `trainSamples` (the training set's size) sets PowerSGD's default start: 10% of the
/// run's planned steps.
TrainerOptions trainerOptions(const CommonFlags& flags, const DistributedContext& ctx,
                              int64_t trainSamples = 0);

/// SGD with Nesterov momentum (weight decay as an L2 term) or AdamW (decoupled decay).
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::vector<at::Tensor>& parameters,
                                                       const CommonFlags& flags);

/// Learning rate at `step` of `totalSteps`: linear warm-up over warmupSteps, then
/// cosine to 0, step decay (x0.1 at 50% and 75%), or constant.
double scheduledLearningRate(const CommonFlags& flags, int64_t step, int64_t totalSteps,
                             int64_t warmupSteps);

/// Installs the schedule on the trainer; the total is epochs x steps per epoch, or
/// maxSteps when smaller.
void installSchedule(Trainer& trainer, const CommonFlags& flags, int64_t trainSamples);

/// Keeps `count` samples of `base` chosen by a seeded permutation (a validation split
/// of a folder that has no test set, or --limit-*).
std::shared_ptr<const Dataset> randomSubset(std::shared_ptr<const Dataset> base, int64_t count,
                                            uint64_t seed, int64_t skip = 0);

/// A folder without a test set: a seeded random `fraction` of it for evaluation, read
/// through `evalView` (the same files without augmentation), the rest from `train`.
/// Returns {train, test}; throws hddp::ConfigError when either part would be empty.
std::pair<std::shared_ptr<const Dataset>, std::shared_ptr<const Dataset>> holdOut(
    std::shared_ptr<const Dataset> train, std::shared_ptr<const Dataset> evalView, double fraction,
    uint64_t seed);

/// --limit-train / --limit-test: seeded random subsets when smaller than the sets.
void applyLimits(const CommonFlags& flags, std::shared_ptr<const Dataset>& train,
                 std::shared_ptr<const Dataset>& test);

/// Sharded evaluation: rank r evaluates its share of `data` (shares follow the
/// trainer's current split, so a slower rank gets fewer samples); `batchSums` returns a
/// batch's sums as a 1-D tensor of `sumCount` values on the device. They are added on
/// the device (no synchronisation per batch) and one allreduce adds the ranks' sums.
/// Returns the global sums. Runs under NoGrad, eval mode and the AMP mode.
std::vector<double> evaluateSharded(
    Trainer& trainer, Communicator& comm, const Dataset& data, int64_t batchSize, AmpMode amp,
    int64_t sumCount,
    const std::function<at::Tensor(const at::Tensor& input, const at::Tensor& target)>& batchSums);

/// True when this epoch (0-based) is evaluated under --eval-every (the last always is).
bool evaluateThisEpoch(const CommonFlags& flags, int64_t epoch);

/// Installs `evaluate` as the trainer's evaluation on the epochs --eval-every selects
/// and at the end of a run that --max-steps stops inside an epoch.
void installEvaluation(Trainer& trainer, const CommonFlags& flags,
                       std::function<std::map<std::string, double>()> evaluate);

/// --init-from / --init-skip: rank 0 loads the state dict file into `model` (every key
/// but the skipped prefixes must match by name and shape, as PyTorch's strict=True) and
/// logs what was loaded and left out; the Trainer's DDP then broadcasts rank 0's weights
/// and buffers, so only rank 0's machine needs the file. Collective: call it on every
/// rank before the Trainer; a failure is a ConfigError on every rank. Does nothing
/// without --init-from. A --resume'd state file, when there is one, replaces it.
void initModelFrom(torch::nn::Module& model, const CommonFlags& flags, Communicator& comm);

/// --export: rank 0 checks that it can write each file's folder, before any training;
/// collective (a ConfigError on every rank when it cannot).
void checkExportPath(const CommonFlags& flags, Communicator& comm);

/// --export: rank 0 writes the model's state dict to each file (.safetensors, else
/// torch.save's .pt, by extension) after training; the other ranks do nothing.
void exportModel(const torch::nn::Module& model, const CommonFlags& flags, int rank);

/// Runs `body`, turning hddp errors into a message on stderr naming the problem and
/// an exit status (2 for configuration or data errors, 1 otherwise). The message is
/// printed as userMessage() gives it after "PROGRAM: "; the whole text, source locations
/// included, goes to the debug log (HDDP_LOG_LEVEL=debug).
int runMain(const char* program, const std::function<int()>& body);

/// An error's text as a user reads it: without hddp's "hddp: " prefixes (one per time
/// the error was passed on, e.g. from rank 0 to the others) and without the source
/// locations ("[state_dict.cpp:257]") that HDDP_CHECK appends.
std::string userMessage(const std::string& what);

}  // namespace examples
}  // namespace hddp
