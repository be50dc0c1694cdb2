// The trainers' rank set-up and training options (example_common.h): the device and emu,
// threads per rank, TrainerOptions from the flags, the optimizer, the learning-rate
// schedule, and main()'s error reporting. The flags are registered in common_flags.cpp,
// subsets and evaluation live in data_and_evaluation.cpp.
#include "example_common.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <sstream>
#include <thread>

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

std::string userMessage(const std::string& what) {
  // " [file.cpp:123]": what HDDP_CHECK appends; "hddp: " at the start and after ": "
  // (an error passed on with a prefix of its own, "on rank 0: hddp: ...").
  static const std::regex kLocation(R"( \[[A-Za-z0-9_.+-]+\.(cpp|cc|cxx|h|hpp):[0-9]+\])");
  static const std::regex kPrefix(R"((^|: )(hddp: )+)");
  const std::string unplaced = std::regex_replace(what, kLocation, "");
  return std::regex_replace(unplaced, kPrefix, "$1");
}

int runMain(const char* program, const std::function<int()>& body) {
  // The message once, without hddp's prefixes and source locations; the whole text in
  // the debug log.
  const auto report = [program](const char* kind, const std::string& what) {
    HDDP_LOG_DEBUG("train", program, ": ", kind, what);
    std::fprintf(stderr, "%s: %s%s\n", program, kind, userMessage(what).c_str());
  };
  try {
    return body();
  } catch (const ConfigError& e) {
    report("configuration error: ", e.what_without_backtrace());
    return 2;
  } catch (const DataError& e) {
    report("data error: ", e.what_without_backtrace());
    return 2;
  } catch (const c10::Error& e) {
    report("", e.what_without_backtrace());
  } catch (const std::exception& e) {
    report("", e.what());
  }
  return 1;
}

}  // namespace examples
}  // namespace hddp
