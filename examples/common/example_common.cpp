#include "example_common.h"

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <thread>

#include "cli_checks.h"
#include "hddp/balance/compression_model.h"
#include "hddp/balance/emulation.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/devices.h"
#include "hddp/comm/launch.h"
#ifdef HDDP_EXAMPLES_WITH_EMU
#include "hddp/emu/emu.h"
#endif
#include "hddp/comm/rendezvous.h"
#include "hddp/core/autocast.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/topology/topology.h"

namespace hddp {
namespace examples {

void addCommonFlags(CLI::App& app, CommonFlags& f) {
  app.add_option("--global-batch", f.globalBatch, "Samples per optimizer step over all ranks")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--epochs", f.epochs, "Passes over the training set")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--max-steps", f.maxSteps, "Stop after this many steps in total (0: no limit)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--time-budget", f.timeBudget,
                 "Stop training after this many seconds (0: no limit); the learning-rate "
                 "schedule ends with it. The final evaluation comes after")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--lr", f.lr, "Peak learning rate")->check(cli::positive())->capture_default_str();
  app.add_option("--schedule", f.schedule,
                 "Learning-rate schedule after warm-up: cosine (to 0), step (x0.1 at 50% and "
                 "75% of the steps) or constant")
      ->check(CLI::IsMember({"cosine", "step", "constant"}))
      ->capture_default_str();
  app.add_option("--warmup-epochs", f.warmupEpochs, "Linear learning-rate warm-up (epochs)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--optimizer", f.optimizer, "sgd (momentum, Nesterov) or adamw")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  app.add_option("--momentum", f.momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--weight-decay", f.weightDecay, "Weight decay")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--amp", f.amp,
                 "Mixed precision: off, bf16 (CPU and CUDA; float32 where the device lacks "
                 "native bf16), fp16 (CUDA, dynamic loss scaling) or auto (bf16 where native, "
                 "else off)")
      ->check(CLI::IsMember({"off", "bf16", "fp16", "auto"}))
      ->capture_default_str();
  app.add_flag("--checkpoint-activations", f.checkpointActivations,
               "Recompute blocks in backward instead of storing their activations");
  app.add_option("--clip-grad-norm", f.clipGradNorm, "Clip the global gradient norm (0: off)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--workers", f.workers, "Data-loading threads per rank (0: load inline)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--prefetch", f.prefetch, "Batches prepared ahead per rank")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--save-dir", f.saveDir, "Write state files here (atomic, CRC-checked)");
  app.add_option("--save-every", f.saveEvery,
                 "Save every N steps (0: at the end of each epoch and of the run)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--resume", f.resume,
                 "Resume from a state file, or the newest valid one in a directory");
  app.add_option("--export", f.exportPath,
                 "After training, write the model's state dict here for Python: FILE.pt "
                 "(torch.load(f, weights_only=True)) or FILE.safetensors");
  auto* initFrom =
      app.add_option("--init-from", f.initFrom,
                     "Start from this state dict (.pt from torch.save(model.state_dict(), f), or "
                     ".safetensors), e.g. torchvision's weights for --model resnet18/34/50");
  app.add_option("--init-skip", f.initSkip,
                 "With --init-from: leave out the keys starting with PREFIX (repeatable), e.g. "
                 "fc. for a new classifier head")
      ->needs(initFrom)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--eval-every", f.evalEvery, "Evaluate every N epochs (the last always)")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--eval-batch", f.evalBatch, "Evaluation batch per rank")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--threads", f.threads,
                 "Intra-op threads per rank (0: this host's cores / ranks on this host)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--metrics", f.metrics,
                 "JSON-lines metrics file (rank r > 0 writes NAME.rank<r>.EXT)");
  app.add_option("--timeline", f.timeline, "Chrome-trace / Perfetto timeline of every rank");
  app.add_option("--tensorboard", f.tensorboard,
                 "TensorBoard event files into this folder (rank 0; tensorboard --logdir DIR)");
  app.add_flag("!--no-balance", f.balance,
               "Equal split of the global batch (PyTorch DDP) instead of the planner's");
  app.add_option("--compress", f.compress,
                 "Gradient compression: none, fp16, bf16 (half the bytes), powersgd[:RANK] "
                 "(low-rank with error feedback, rank 1 by default; for slow links) or auto "
                 "(chosen from the slowest link and the backward it can hide behind)")
      ->check([](const std::string& v) -> std::string {
        if (v == "auto") {
          return {};
        }
        try {
          CompressionSpec::parse(v);
          return {};
        } catch (const ConfigError&) {
          return "'" + v +
                 "' is not none, fp16, bf16, powersgd, powersgd:RANK (RANK a whole "
                 "number from 1) or auto";
        }
      });
  app.add_option("--zero", f.zero,
                 "ZeRO: 0 plain data parallelism, 1 shard the optimizer state across ranks, 2 "
                 "the gradients too (sgd and adamw; not with --compress)")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  app.add_option("--shard-by", f.shardBy,
                 "With --zero: size the shards by free device memory (memory), equally "
                 "(equal) or by ratios per rank (1:3)")
      ->check([](const std::string& v) -> std::string {
        try {
          parseShardBy(v);
          return {};
        } catch (const ConfigError& e) {
          return e.what_without_backtrace();
        }
      })
      ->capture_default_str();
  app.add_option("--compress-start", f.compressStart,
                 "PowerSGD: plain allreduce for this many steps first (default: 10% of the "
                 "run's planned steps, at least 2)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--emulate-slowdown", f.emulateSlowdown,
                 "DEMO ONLY: stretch ranks' compute, e.g. 1:3 (rank 1 three times slower)");
  app.add_option("--emulate-link-gbps", f.emulateLinkGbps,
                 "DEMO ONLY: limit ranks' link, e.g. 1:2.8 (GB/s): their input copies, and "
                 "every collective to a ring over the slowest listed link");
  app.add_option("--emulate-link-latency-us", f.emulateLinkLatencyUs,
                 "DEMO ONLY: latency per message of the emulated link (microseconds)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--emulate-memory-cap", f.emulateMemoryCap,
                 "DEMO ONLY: ranks run out of memory above this many samples, e.g. 1:40");
  app.add_option("--emulate-memory", f.emulateMemory,
                 "DEMO ONLY: ranks' device memory in MiB, FIXED+PER_SAMPLE/TOTAL, e.g. "
                 "1:200+12/1000 (measured, caps derived from it, out of memory above TOTAL)");
  app.add_option("--max-local-batch", f.maxLocalBatch,
                 "Memory caps: the most samples a rank may get per step, e.g. 1:40 or 0:96,1:40 "
                 "(otherwise learned when a rank runs out of memory)");
  app.add_option("--seed", f.seed, "Seed of initialisation, shuffling and augmentation")
      ->capture_default_str();
  app.add_option("--limit-train", f.limitTrain, "Train on this many samples (0: all)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--limit-test", f.limitTest, "Evaluate on this many samples (0: all)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--device", f.device,
                 "This program's device: cpu, cuda or cuda:N (default: HDDP_DEVICE, which "
                 "hddp-run --devices sets, else cuda:<local rank> with CUDA, else cpu)");
  app.add_option("--log-every", f.logEvery, "Progress lines and metrics every N steps")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--progress", f.progress, "auto (a live bar on a terminal), lines or off")
      ->check(CLI::IsMember({"auto", "lines", "off"}))
      ->capture_default_str();
}

namespace {

// Whether a device name ("emu", "emu:1") names hddp's emulated accelerator.
bool namesEmulator(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  text.erase(0, text.find_first_not_of(" \t"));
  return text == "emu" || text.rfind("emu:", 0) == 0;
}

// The device text this rank resolves its device from, as hddp::resolveDevice reads it:
// --device, else this local rank's entry of HDDP_DEVICE (the whole text when it names one
// device for all, every entry when the launch information does not pick one, which
// resolveDevice then reports).
std::vector<std::string> rankDeviceTexts(const CommonFlags& flags) {
  if (!flags.device.empty()) {
    return {flags.device};
  }
  const char* list = std::getenv("HDDP_DEVICE");
  if (list == nullptr) {
    return {};
  }
  std::vector<std::string> entries;
  std::stringstream in(list);
  for (std::string entry; std::getline(in, entry, ',');) {
    entries.push_back(entry);
  }
  if (entries.size() > 1) {
    // This rank's entry by the local rank resolveDevice will use (torchrun's LOCAL_RANK,
    // Slurm's SLURM_LOCALID, Open MPI's, ...).
    try {
      const auto r =
          static_cast<size_t>(detectLaunch(InitOptions{}, processEnvironment()).localRank);
      if (r < entries.size()) {
        return {entries[r]};
      }
    } catch (const std::exception&) {
      // malformed launch variables: initialization reports them
    }
  }
  return entries;
}

// Installs hddp::emu (HDDP_EMU_* configure it) when this rank's device is emu, and only
// then: with emu installed, LibTorch pins host memory for emu instead of CUDA, so a CUDA
// rank of a job whose other rank is on emu must not install it.
void installEmulatorIfNamed(const CommonFlags& flags) {
  const auto texts = rankDeviceTexts(flags);
  if (std::none_of(texts.begin(), texts.end(), namesEmulator)) {
    return;
  }
#ifdef HDDP_EXAMPLES_WITH_EMU
  hddp::emu::install();
  HDDP_LOG_INFO("train", "hddp::emu installed: ", hddp::emu::deviceCount(),
                " emulated device(s) on the CPU (HDDP_EMU_* variables)");
#else
  HDDP_THROW(ConfigError,
             "a device names emu, but this build has no hddp::emu "
             "(configure with -DHDDP_BUILD_EMU=ON)");
#endif
}

}  // namespace

InitOptions initOptions(const CommonFlags& flags) {
  installEmulatorIfNamed(flags);
  InitOptions o;
  if (!flags.device.empty()) {
    o.device = parseDeviceName(flags.device, "--device");
  }
  return o;
}

DistributedContext initRank(const CommonFlags& flags) {
  auto ctx = initFromEnv(initOptions(flags));
#ifdef HDDP_EXAMPLES_WITH_EMU
  if (ctx.device.is_privateuseone() && ctx.device.has_index() && hddp::emu::isInstalled()) {
    hddp::emu::setOwnDevice(ctx.device.index());
  }
#endif
  return ctx;
}

int applyThreads(const CommonFlags& flags, const DistributedContext& ctx) {
  int threads = flags.threads;
  if (threads <= 0) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    int sharing = std::max(1, ctx.info.localWorldSize);
    // A job of GPU and CPU ranks (hddp-run --devices cuda:0,cpu): the CPU ranks compute
    // on the cores, the GPU ranks mostly launch kernels; each GPU rank keeps one core.
    const char* list = std::getenv("HDDP_DEVICE");
    if (ctx.device.is_cpu() && list && std::string(list).find(',') != std::string::npos) {
      // By the entries' text: another rank's device (emu) need not be known here.
      std::vector<std::string> entries;
      std::stringstream in(list);
      for (std::string entry; std::getline(in, entry, ',');) {
        entry.erase(0, entry.find_first_not_of(" \t"));
        entry.erase(entry.find_last_not_of(" \t") + 1);
        std::transform(entry.begin(), entry.end(), entry.begin(),
                       [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
        entries.push_back(entry);
      }
      const auto cpuRanks = std::count(entries.begin(), entries.end(), std::string("cpu"));
      const int gpuRanks = static_cast<int>(entries.size()) - static_cast<int>(cpuRanks);
      if (gpuRanks > 0 && cores > gpuRanks) {
        threads = std::max(1, (cores - gpuRanks) / static_cast<int>(cpuRanks));
      }
    }
    if (threads <= 0) {
      threads = std::max(1, cores / sharing);
    }
  }
  torch::set_num_threads(threads);
  return threads;
}

namespace {

// --compress: DDP's compression. PowerSGD starts after --compress-start steps, else after
// 10% of the run's planned steps (PyTorch's advice for start_powerSGD_iter).
void applyCompression(const CommonFlags& f, int64_t trainSamples, int rank, DdpOptions& ddp) {
  if (f.compress == "none") {
    return;
  }
  if (f.compress == "fp16" || f.compress == "bf16") {
    ddp.compression = f.compress == "fp16" ? GradCompression::Fp16 : GradCompression::Bf16;
    return;
  }
  const bool autoChoice = f.compress == "auto";
  ddp.compression = autoChoice ? GradCompression::Auto : GradCompression::PowerSgd;
  if (!autoChoice) {
    ddp.powerSgd.rank = CompressionSpec::parse(f.compress).rank;
  }
  int64_t planned = f.maxSteps;
  if (trainSamples > 0 && f.globalBatch > 0) {
    const int64_t perEpoch = (trainSamples + f.globalBatch - 1) / f.globalBatch;
    planned = planned > 0 ? std::min(planned, perEpoch * f.epochs) : perEpoch * f.epochs;
  }
  ddp.powerSgd.startStep =
      f.compressStart > 0 ? f.compressStart : std::max<int64_t>(2, planned / 10);
  HDDP_CHECK_AS(ConfigError, ddp.powerSgd.startStep >= 2,
                "--compress-start must be at least 2 with PowerSGD (its memories need DDP's "
                "rebuilt buckets), got ",
                ddp.powerSgd.startStep);
  if (rank == 0 && autoChoice) {
    std::printf("gradient compression: auto (if PowerSGD, from step %lld: %s)\n",
                static_cast<long long>(ddp.powerSgd.startStep),
                f.compressStart > 0 ? "--compress-start" : "10% of the planned steps");
  } else if (rank == 0) {
    std::printf("gradient compression: PowerSGD rank %d from step %lld (%s)\n", ddp.powerSgd.rank,
                static_cast<long long>(ddp.powerSgd.startStep),
                f.compressStart > 0 ? "--compress-start" : "10% of the planned steps");
  }
}

}  // namespace

TrainerOptions trainerOptions(const CommonFlags& f, const DistributedContext& ctx,
                              int64_t trainSamples) {
  TrainerOptions o;
  applyCompression(f, trainSamples, ctx.rank(), o.ddp);
  o.launch = ctx.info;  // what initFromEnv read: the Trainer need not read it again
  o.globalBatch = f.globalBatch;
  o.epochs = f.epochs;
  o.maxSteps = f.maxSteps;
  o.timeBudgetSeconds = f.timeBudget;
  o.seed = f.seed;
  if (f.amp == "auto") {
    // bf16 where the device computes it natively, else float32.
    const Bf16Support bf16 = bf16Support(ctx.device);
    o.amp = bf16.native ? AmpMode::Bf16 : AmpMode::Off;
    HDDP_LOG_INFO("train", "--amp auto on ", ctx.device.str(), ": ",
                  bf16.native ? "bf16" : "float32", " (", bf16.why, ")");
  } else {
    o.amp = parseAmpMode(f.amp);
  }
  HDDP_CHECK_AS(ConfigError, !(o.amp == AmpMode::Fp16 && ctx.device.is_cpu()),
                "--amp fp16 needs a GPU (this rank runs on ", ctx.device.str(),
                "); use --amp bf16 on CPU");
  o.clipGradNorm = f.clipGradNorm;
  o.zero = f.zero;
  o.shardBy = parseShardBy(f.shardBy);
  o.balance = f.balance;
  o.loader.workers = f.workers;
  o.loader.depth = f.prefetch;
  o.metricsPath = f.metrics;
  o.timelinePath = f.timeline;
  o.tensorboard = f.tensorboard;
  o.logEvery = f.logEvery;
  o.progress = f.progress == "off"     ? ProgressMode::Off
               : f.progress == "lines" ? ProgressMode::Lines
                                       : ProgressMode::Auto;
  o.saveDir = f.saveDir;
  o.saveEvery = f.saveEvery;
  o.resume = f.resume;
  if (!f.maxLocalBatch.empty()) {
    o.maxLocalBatch = parseRankCaps("--max-local-batch", f.maxLocalBatch, ctx.worldSize());
  }
  if (!f.emulateSlowdown.empty() || !f.emulateLinkGbps.empty() || !f.emulateMemoryCap.empty() ||
      !f.emulateMemory.empty() || f.emulateLinkLatencyUs > 0) {
    // flags override the environment
    EmulationOptions e = emulationFromEnv(ctx.rank(), ctx.worldSize());
    const auto rank = static_cast<size_t>(ctx.rank());
    if (!f.emulateSlowdown.empty()) {
      e.slowdown =
          parseRankValues("--emulate-slowdown", f.emulateSlowdown, ctx.worldSize(), 1.0)[rank];
    }
    if (!f.emulateLinkGbps.empty()) {
      const std::vector<double> links =
          parseRankValues("--emulate-link-gbps", f.emulateLinkGbps, ctx.worldSize(), 0.0);
      e.linkBytesPerSecond = links[rank] * 1e9;
      e.collectiveBytesPerSecond = slowestEmulatedLink(links);
    }
    if (f.emulateLinkLatencyUs > 0) {
      e.linkLatencySeconds = f.emulateLinkLatencyUs * 1e-6;
    }
    if (!f.emulateMemoryCap.empty()) {
      e.memoryCapSamples =
          parseRankCaps("--emulate-memory-cap", f.emulateMemoryCap, ctx.worldSize())[rank];
    }
    if (!f.emulateMemory.empty()) {
      parseEmulatedMemory("--emulate-memory", f.emulateMemory, ctx.worldSize(), ctx.rank(), e);
    }
    e.validate(ctx.rank());
    o.emulation = e;
  }
  return o;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::vector<at::Tensor>& parameters,
                                                       const CommonFlags& f) {
  if (f.optimizer == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        parameters, torch::optim::AdamWOptions(f.lr).weight_decay(f.weightDecay));
  }
  return std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(f.lr)
                                                             .momentum(f.momentum)
                                                             .nesterov(f.momentum > 0)
                                                             .weight_decay(f.weightDecay));
}

double scheduledLearningRate(const CommonFlags& f, int64_t step, int64_t totalSteps,
                             int64_t warmupSteps) {
  if (step < warmupSteps) {
    return f.lr * static_cast<double>(step + 1) / static_cast<double>(warmupSteps);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, totalSteps - warmupSteps));
  const double t = std::min(1.0, static_cast<double>(step - warmupSteps) / span);
  if (f.schedule == "cosine") {
    return f.lr * 0.5 * (1.0 + std::cos(M_PI * t));
  }
  if (f.schedule == "step") {
    return f.lr * (t < 0.5 ? 1.0 : t < 0.75 ? 0.1 : 0.01);
  }
  return f.lr;
}

void installSchedule(Trainer& trainer, const CommonFlags& f, int64_t trainSamples) {
  const int64_t perEpoch = (trainSamples + f.globalBatch - 1) / f.globalBatch;
  int64_t total = perEpoch * f.epochs;
  if (f.maxSteps > 0) {
    total = std::min(total, f.maxSteps);
  }
  const auto warmup = static_cast<int64_t>(std::llround(f.warmupEpochs * perEpoch));
  trainer.setSchedule([f, total, warmup](const StepInfo& info, torch::optim::Optimizer& opt) {
    // The Trainer's planned total: shorter than epochs x steps when a time budget ends
    // the run earlier, so the schedule still reaches its end.
    const int64_t planned = info.totalSteps > 0 ? std::min(total, info.totalSteps) : total;
    setLearningRate(opt, scheduledLearningRate(f, info.step, planned, warmup));
  });
}

namespace {

class IndexedSubset : public Dataset {
 public:
  IndexedSubset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices)
      : base_(std::move(base)), indices_(std::move(indices)) {}
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Example get(int64_t index, SampleRng& rng) const override {
    return base_->get(indices_.at(static_cast<size_t>(index)), rng);
  }
  std::string describe() const override {
    return c10::str(base_->describe(), " (", indices_.size(), " of them)");
  }

 private:
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
};

}  // namespace

std::shared_ptr<const Dataset> randomSubset(std::shared_ptr<const Dataset> base, int64_t count,
                                            uint64_t seed, int64_t skip) {
  const int64_t n = base->size();
  HDDP_CHECK_AS(ConfigError, count >= 0 && skip >= 0 && skip + count <= n, "cannot take ", count,
                " samples after skipping ", skip, " from ", base->describe(), ": it has only ", n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed ^ 0x5eedull);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int64_t> picked(order.begin() + skip, order.begin() + skip + count);
  std::sort(picked.begin(), picked.end());
  return std::make_shared<IndexedSubset>(std::move(base), std::move(picked));
}

std::pair<std::shared_ptr<const Dataset>, std::shared_ptr<const Dataset>> holdOut(
    std::shared_ptr<const Dataset> train, std::shared_ptr<const Dataset> evalView, double fraction,
    uint64_t seed) {
  const int64_t n = train->size();
  HDDP_CHECK_AS(ConfigError, evalView->size() == n, "holdOut: the evaluation view has ",
                evalView->size(), " samples, the training set ", n);
  const auto held = static_cast<int64_t>(static_cast<double>(n) * fraction);
  HDDP_CHECK_AS(ConfigError, held >= 1 && held < n, "--val-fraction ", fraction, " of ", n,
                " images leaves no training or no validation images; give --test-data DIR or "
                "another fraction");
  auto test = randomSubset(std::move(evalView), held, seed, 0);
  return {randomSubset(std::move(train), n - held, seed, held), std::move(test)};
}

void applyLimits(const CommonFlags& flags, std::shared_ptr<const Dataset>& train,
                 std::shared_ptr<const Dataset>& test) {
  if (flags.limitTrain > 0 && flags.limitTrain < train->size()) {
    train = randomSubset(train, flags.limitTrain, flags.seed);
  }
  if (flags.limitTest > 0 && flags.limitTest < test->size()) {
    test = randomSubset(test, flags.limitTest, flags.seed + 7);
  }
}

std::vector<double> evaluateSharded(
    Trainer& trainer, Communicator& comm, const Dataset& data, int64_t batchSize, AmpMode amp,
    int64_t sumCount,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& batchSums) {
  // Shares follow the current split (a slower rank evaluates fewer samples).
  const ItemRange shard = shardOf(data.size(), trainer.plan(), comm.rank());
  const int64_t begin = shard.begin;
  const int64_t end = shard.end;

  const c10::Device device = trainer.device();  // the rank's, not the communicator's
  at::Tensor total = at::zeros({sumCount}, at::TensorOptions().dtype(at::kDouble).device(device));
  torch::NoGradGuard noGrad;
  trainer.ddp().module().eval();
  std::optional<AutocastGuard> autocast;
  if (amp != AmpMode::Off) {
    autocast.emplace(device.type(), amp == AmpMode::Fp16 ? at::kHalf : at::kBFloat16);
  }
  SampleRng rng(0);  // evaluation data is not augmented; the rng is unused
  for (int64_t first = begin; first < end; first += batchSize) {
    const int64_t last = std::min(end, first + batchSize);
    std::vector<Example> examples;
    examples.reserve(static_cast<size_t>(last - first));
    for (int64_t i = first; i < last; ++i) {
      examples.push_back(data.get(i, rng));
    }
    Example batch = collate(examples);
    at::Tensor sums = batchSums(batch.input.to(device), batch.target.to(device));
    HDDP_CHECK(sums.dim() == 1 && sums.size(0) == sumCount, "evaluateSharded: batchSums returned ",
               sums.sizes(), ", expected [", sumCount, "]");
    total += sums.to(at::kDouble);
  }
  comm.allreduce(total).wait();
  total = total.cpu();
  return std::vector<double>(total.data_ptr<double>(), total.data_ptr<double>() + sumCount);
}

bool evaluateThisEpoch(const CommonFlags& flags, int64_t epoch) {
  return (epoch + 1) % flags.evalEvery == 0 || epoch + 1 == flags.epochs;
}

void installEvaluation(Trainer& trainer, const CommonFlags& flags,
                       std::function<std::map<std::string, double>()> evaluate) {
  trainer.setEvaluation([&trainer, flags, evaluate = std::move(evaluate)](
                            int64_t epoch) -> std::map<std::string, double> {
    const bool stopped = trainer.stoppedEarly();
    if (!evaluateThisEpoch(flags, epoch) && !stopped) {
      return {};  // the Trainer keeps the last evaluation
    }
    return evaluate();
  });
}

int runMain(const char* program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "%s: configuration error: %s\n", program, e.what_without_backtrace());
    return 2;
  } catch (const DataError& e) {
    std::fprintf(stderr, "%s: data error: %s\n", program, e.what_without_backtrace());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  return 1;
}

}  // namespace examples
}  // namespace hddp
