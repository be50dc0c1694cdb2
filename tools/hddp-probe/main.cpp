// hddp-probe: what this node has, how it is attached, and how hddp would split a batch.
//   hddp-probe                       devices, links, eGPUs, bandwidth, versions, advice, split
//   hddp-probe --global-batch 256 --sample-bytes 12288 --json
// Compute speed comes from a short calibration (an MLP training step per device);
// HDDP_EMULATE_SLOWDOWN is applied to it per rank for demos (announced).
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "hddp/hddp.h"
#ifdef HDDP_PROBE_WITH_EMU
#include "hddp/emu/emu.h"
#endif
#include "job_record.h"
#include "what_if.h"

namespace {

using json = nlohmann::json;

// Waits for the work queued on `device` (any accelerator; nothing for the CPU).
void synchronize(const c10::Device& device) {
  if (!device.is_cpu()) {
    c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
  }
}

// Seconds per sample of a small MLP training step (3072 -> 1024 -> 10) on `device`.
double calibrate(const c10::Device& device, int64_t batch) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(3072, 1024), torch::nn::ReLU(),
                            torch::nn::Linear(1024, 10));
  net->to(device);
  torch::optim::SGD opt(net->parameters(), 0.01);
  auto x = torch::randn({batch, 3072}, device);
  auto y =
      torch::randint(0, 10, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    synchronize(device);
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    torch::cross_entropy_loss(net->forward(x), y).backward();
    opt.step();
    synchronize(device);
    if (i > 0)
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / static_cast<double>(batch);
}

// The device's free memory now (its total minus what every process holds on it).
int64_t freeBytes(const c10::Device& device) {
  if (device.is_cpu()) {
    return 0;
  }
  auto* allocator = dynamic_cast<c10::DeviceAllocator*>(c10::GetAllocator(device.type()));
  if (allocator == nullptr) {
    return 0;
  }
  return static_cast<int64_t>(allocator->getMemoryInfo(device.index()).first);
}

// Whether a device is an accelerator hddp-probe plans a rank for: a CUDA device, or one
// of a PrivateUse1 backend (hddp::emu).
bool isAccelerator(const c10::Device& device) {
  return device.is_cuda() || device.type() == c10::DeviceType::PrivateUse1;
}

// Installs hddp::emu when HDDP_EMU_DEVICES is set or HDDP_DEVICE names emu, so that the
// emulated devices are listed and planned for as a training job would see them.
void installEmulatorIfAsked() {
  const char* count = std::getenv("HDDP_EMU_DEVICES");
  const char* device = std::getenv("HDDP_DEVICE");
  std::string text = device ? device : "";
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const bool named = text.rfind("emu", 0) == 0 || text.find(",emu") != std::string::npos;
  if (!(count && *count) && !named) {
    return;
  }
#ifdef HDDP_PROBE_WITH_EMU
  hddp::emu::install();
#else
  throw std::runtime_error(
      "HDDP_EMU_DEVICES or HDDP_DEVICE asks for hddp::emu, but this build has none "
      "(configure with -DHDDP_BUILD_EMU=ON)");
#endif
}

std::string gib(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  return b;
}

// hddp-probe's copies: 32 MiB, best of 3 (a quick look, not a benchmark).
hddp::BandwidthOptions probeCopies(bool pinned) {
  hddp::BandwidthOptions o;
  o.pinned = pinned;
  o.bytes = 32 << 20;
  o.repeats = 3;
  return o;
}

}  // namespace

int run(int argc, char** argv);

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "hddp-probe: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp-probe: %s\n", e.what());
  }
  return 1;
}

namespace {

// What the command line asks for.
struct ProbeOptions {
  int64_t globalBatch = 256;
  double sampleBytes = 3 * 32 * 32 * 4;
  double sampleMiB = 0;
  double fixedMiB = 0;
  double headroom = 0.10;
  int cpuRanks = 1;
  std::string sysfs = "/sys";
  bool asJson = false;
  bool skipBandwidth = false;
  double paramBytes = 0;
};

json versions(bool hasCuda) {
  auto& hooks = at::detail::getCUDAHooks();
  return {{"hddp", hddp::version()},
          {"libtorch", TORCH_VERSION},
          {"cuda_runtime", hasCuda ? std::to_string(hooks.versionCUDART()) : "none"},
          {"cudnn", hasCuda ? std::to_string(hooks.versionCuDNN()) : "none"},
          {"nccl", hddp::ncclVersion()},
          {"built_with_cuda", hddp::builtWithCuda()}};
}

// Each device as JSON: properties, link, eGPU, measured bandwidth; advice on the way.
json describeDevices(const std::vector<hddp::DeviceInfo>& devices, const ProbeOptions& o,
                     bool hasCuda, std::vector<std::string>& advice) {
  const bool skipBandwidth = o.skipBandwidth;
  json devs = json::array();
  for (const auto& d : devices) {
    json j = {{"device", d.device.str()}, {"name", d.name}, {"memory_bytes", d.memoryBytes}};
    if (isAccelerator(d.device)) {
      j["free_bytes"] = freeBytes(d.device);
      j["sm_count"] = d.smCount;
      j["compute_capability"] =
          std::to_string(d.computeMajor) + "." + std::to_string(d.computeMinor);
      j["pci_bus_id"] = d.pciBusId;
      j["nvml"] = d.nvmlSeen;
      if (d.link) {
        j["link"] = {{"current_gen", d.link->currentGen},
                     {"current_width", d.link->currentWidth},
                     {"max_gen", d.link->maxGen},
                     {"max_width", d.link->maxWidth},
                     {"current_GBps", d.link->currentGBps()},
                     {"limiting_hop", d.link->limitingHop}};
        if (d.link->degraded()) {
          advice.push_back(
              d.device.str() + " runs its link at Gen" + std::to_string(d.link->currentGen) + " x" +
              std::to_string(d.link->currentWidth) + ", below its maximum Gen" +
              std::to_string(d.link->maxGen) + " x" + std::to_string(d.link->maxWidth) +
              ": check the slot and riser or the enclosure's cable (idle cards may also downclock "
              "the link; check again under load)");
        }
      }
      if (d.external) {
        j["egpu"] = *d.external;
        advice.push_back(
            d.device.str() + " is an eGPU (" + *d.external +
            "): expect ~2.8 GB/s host<->device on a " +
            "PCIe 3.0 x4 Thunderbolt link; use prefetch (pinned memory, side stream) and AMP, keep "
            "data " +
            "on the device, and if NCCL hangs across the enclosure try NCCL_P2P_DISABLE=1 (and " +
            "NCCL_SHM_DISABLE=1 between processes that cannot share memory)");
      }
    } else {
      j["cores"] = d.smCount;
      j["link"] = "memory";
    }
    if (!skipBandwidth && (d.device.is_cuda() || !hasCuda)) {
      auto pageable = hddp::measureBandwidth(d.device, probeCopies(/*pinned=*/false));
      j["bandwidth_pageable_GBps"] = {{"h2d", pageable.hostToDeviceGBps},
                                      {"d2h", pageable.deviceToHostGBps}};
      double linkBps = pageable.hostToDeviceGBps * 1e9;
      if (d.device.is_cuda()) {
        auto pinned = hddp::measureBandwidth(d.device, probeCopies(/*pinned=*/true));
        j["bandwidth_pinned_GBps"] = {{"h2d", pinned.hostToDeviceGBps},
                                      {"d2h", pinned.deviceToHostGBps}};
        linkBps = pinned.hostToDeviceGBps * 1e9;
      }
      j["measured_link_Bps"] = linkBps;
    }
    devs.push_back(j);
  }
  return devs;
}

// The split hddp would use: one rank per CUDA device (else o.cpuRanks CPU ranks), each
// calibrated once per device, with links and memory caps.
struct ProbePlan {
  std::vector<c10::Device> rankDevices;
  std::vector<hddp::RankCost> costs;
  hddp::BatchPlan plan;
  hddp::BatchPlan equal;
  json ranks;
  double slowestLinkBytesPerSecond = 0.0;
  double allreduceSeconds = 0.0;  // ring allreduce of --param-bytes over the slowest link
};

ProbePlan planSplit(const std::vector<hddp::DeviceInfo>& devices, const json& devs,
                    const ProbeOptions& o) {
  const int64_t globalBatch = o.globalBatch;
  const double sampleBytes = o.sampleBytes;
  const double sampleMiB = o.sampleMiB;
  const int cpuRanks = o.cpuRanks;
  ProbePlan result;
  std::vector<c10::Device>& rankDevices = result.rankDevices;
  std::vector<hddp::RankCost>& costs = result.costs;
  for (const auto& d : devices) {
    if (isAccelerator(d.device)) rankDevices.push_back(d.device);
  }
  if (rankDevices.empty()) {
    rankDevices.assign(static_cast<size_t>(std::max(1, cpuRanks)), c10::Device(c10::kCPU));
  }
  json ranks = json::array();
  // One calibration per device: ranks sharing a device (CPU ranks) get the same speed,
  // which a second timing under a different load would not give them.
  std::map<std::string, double> calibrated;
  for (size_t r = 0; r < rankDevices.size(); ++r) {
    const auto& dev = rankDevices[r];
    const auto emulation =
        hddp::emulationFromEnv(static_cast<int>(r), static_cast<int>(rankDevices.size()));
    if (!calibrated.count(dev.str())) {
      calibrated[dev.str()] = calibrate(dev, 64);
    }
    hddp::RankProfile profile;
    profile.device = dev;
    profile.bytesPerSample = sampleBytes;
    for (const auto& d : devices) {
      if (d.device == dev) {
        profile.link = d.link;
        profile.external = d.external;
        if (sampleMiB > 0) {
          // The Trainer's rule for a derived cap (hddp/balance/memory_model.h), from the
          // memory given per sample and the device's memory free now.
          hddp::MemoryEstimator::Fit fit;
          fit.steps = 1;
          fit.fixedBytes = o.fixedMiB * (1 << 20);
          fit.perSampleBytes = sampleMiB * (1 << 20);
          fit.totalBytes = static_cast<double>(d.memoryBytes);
          fit.otherBytes =
              dev.is_cpu() ? 0 : static_cast<double>(d.memoryBytes - freeBytes(dev));
          profile.maxSamples = hddp::MemoryEstimator::capFor(fit, o.headroom);
        }
      }
    }
    for (const auto& j : devs) {
      if (j["device"] == dev.str() && j.contains("measured_link_Bps") && dev.is_cuda()) {
        profile.measuredBytesPerSecond = j["measured_link_Bps"].get<double>();
      }
    }
    if (emulation.memoryCapSamples > 0) {
      profile.maxSamples = std::min(profile.maxSamples, emulation.memoryCapSamples);
    }
    if (emulation.emulatesMemory()) {  // an emulated device's memory, for demos and tests
      hddp::MemoryEstimator::Fit fit;
      fit.steps = 1;
      fit.fixedBytes = emulation.memoryFixedBytes;
      fit.perSampleBytes = emulation.memoryPerSampleBytes;
      fit.totalBytes = emulation.memoryTotalBytes;
      profile.maxSamples =
          std::min(profile.maxSamples, hddp::MemoryEstimator::capFor(fit, o.headroom));
    }
    // The seed rule the Trainer starts its planner from (hddp/balance/seed.h), with the
    // MLP calibration as the timed pass and the loader's side-stream copies.
    hddp::SeedMeasurement measured;
    measured.computeSecondsPerSample = calibrated[dev.str()];
    measured.pinnedSideStreamCopies = true;
    profile = hddp::seedProfile(profile, measured, emulation);
    const hddp::RankCost c = hddp::costOf(profile);
    costs.push_back(c);
    ranks.push_back({{"rank", r},
                     {"device", dev.str()},
                     {"compute_s_per_sample", c.secondsPerSample},
                     {"transfer_s_per_sample", c.transferSecondsPerSample()},
                     {"transfer_overlapped", c.transferOverlapped},
                     {"link_GBps", c.linkBytesPerSecond / 1e9},
                     {"link_source", hddp::linkSource(profile)},
                     {"emulated_slowdown", emulation.slowdown}});
  }
  result.plan = hddp::solveSplit(costs, globalBatch);
  result.equal = hddp::equalSplit(static_cast<int>(costs.size()), globalBatch);
  const hddp::BatchPlan& plan = result.plan;
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r]["local_batch"] = plan.local[r];
    ranks[r]["predicted_step_s"] = costs[r].predict(plan.local[r]);
    ranks[r]["memory_cap"] = costs[r].maxSamples == std::numeric_limits<int64_t>::max()
                                 ? json(nullptr)
                                 : json(costs[r].maxSamples);
  }
  result.ranks = ranks;
  // The allreduce over the slowest link: a term no split changes.
  const hddp::AllreducePrediction allreduce = hddp::predictAllreduce(costs, o.paramBytes);
  result.slowestLinkBytesPerSecond = allreduce.slowestLinkBytesPerSecond;
  result.allreduceSeconds = allreduce.seconds;
  return result;
}

// The human-readable report (--json prints `out` instead).
void printReport(const json& out, const std::vector<hddp::DeviceInfo>& devices, const json& devs,
                 const ProbePlan& p, const ProbeOptions& o,
                 const std::vector<std::string>& advice) {
  const int64_t globalBatch = o.globalBatch;
  const double sampleBytes = o.sampleBytes;
  const auto& costs = p.costs;
  const auto& rankDevices = p.rankDevices;
  const auto& plan = p.plan;
  const auto& equal = p.equal;
  std::printf("hddp %s, LibTorch %s, CUDA runtime %s, cuDNN %s, NCCL %s\n\n", hddp::version(),
              TORCH_VERSION, out["versions"]["cuda_runtime"].get<std::string>().c_str(),
              out["versions"]["cudnn"].get<std::string>().c_str(), hddp::ncclVersion().c_str());
  std::printf("Devices\n");
  for (const auto& d : devices) {
    std::printf("  %-7s %s, %s", d.device.str().c_str(), d.name.c_str(),
                gib(d.memoryBytes).c_str());
    if (d.device.is_cuda()) {
      std::printf(" (%s free), %d SMs, sm_%d%d, %s", gib(freeBytes(d.device)).c_str(), d.smCount,
                  d.computeMajor, d.computeMinor, d.pciBusId.c_str());
      if (d.link) {
        std::printf(", PCIe Gen%d x%d (max Gen%d x%d, %.1f GB/s)", d.link->currentGen,
                    d.link->currentWidth, d.link->maxGen, d.link->maxWidth, d.link->currentGBps());
      }
      if (d.external) std::printf(", eGPU: %s", d.external->c_str());
    } else if (isAccelerator(d.device)) {
      std::printf(" (%s free)", gib(freeBytes(d.device)).c_str());
    } else {
      std::printf(", %d cores, link: memory", d.smCount);
    }
    std::printf("\n");
  }
  for (const auto& j : devs) {
    if (j.contains("bandwidth_pageable_GBps")) {
      std::printf("  %-7s measured: pageable %.2f / %.2f GB/s (to / from)",
                  j["device"].get<std::string>().c_str(),
                  j["bandwidth_pageable_GBps"]["h2d"].get<double>(),
                  j["bandwidth_pageable_GBps"]["d2h"].get<double>());
      if (j.contains("bandwidth_pinned_GBps")) {
        std::printf(", pinned %.2f / %.2f GB/s", j["bandwidth_pinned_GBps"]["h2d"].get<double>(),
                    j["bandwidth_pinned_GBps"]["d2h"].get<double>());
      }
      std::printf("\n");
    }
  }
  std::printf("\nSplit of a global batch of %lld (calibrated MLP step; --sample-bytes %.0f)\n",
              static_cast<long long>(globalBatch), sampleBytes);
  std::printf("  %-4s %-7s %14s %10s %10s %8s %12s\n", "rank", "device", "compute s/smp",
              "link GB/s", "mem cap", "batch", "pred. step s");
  for (size_t r = 0; r < costs.size(); ++r) {
    std::printf("  %-4zu %-7s %14.3e %10s %10s %8lld %12.4f\n", r, rankDevices[r].str().c_str(),
                costs[r].secondsPerSample,
                costs[r].linkBytesPerSecond > 0
                    ? std::to_string(costs[r].linkBytesPerSecond / 1e9).substr(0, 5).c_str()
                    : "-",
                costs[r].maxSamples == std::numeric_limits<int64_t>::max()
                    ? "-"
                    : std::to_string(costs[r].maxSamples).c_str(),
                static_cast<long long>(plan.local[r]), costs[r].predict(plan.local[r]));
  }
  std::printf("  predicted step: %.4f s with this split, %.4f s with an equal split\n",
              plan.predictedStepSeconds, hddp::predictedSeconds(costs, equal.local));
  if (o.paramBytes > 0) {
    if (p.allreduceSeconds > 0) {
      std::printf(
          "  allreduce of %.1f MB over the slowest link (%.2f GB/s, ring): %.4f s per step, "
          "which no split changes (part of it hides behind backward)\n",
          o.paramBytes / 1e6, p.slowestLinkBytesPerSecond / 1e9, p.allreduceSeconds);
    } else {
      std::printf("  allreduce: no link term (one rank, or ranks without a host link)\n");
    }
  }
  std::printf("\nEnvironment\n%s", hddp::env::dump().c_str());
  std::printf("\nAdvice\n");
  if (advice.empty()) std::printf("  nothing to report\n");
  for (const auto& a : advice) std::printf("  - %s\n", a.c_str());
}

// --check-device: 0 when the device is there and runs a kernel, 1 when not, 2 on a bad
// name.
int checkDeviceAnswers(const std::string& name) {
  const int cudaCount =
      at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  c10::Device device(c10::kCPU);
  try {
    if (name.rfind("slot:", 0) == 0) {
      hddp::LaunchInfo info;
      info.slot = std::stoi(name.substr(5));
      info.localRank = info.slot;
      info.localWorldSize = info.slot + 1;
      device = hddp::resolveDevice(info, std::nullopt, hddp::processEnvironment(), cudaCount,
                                   /*allowShared=*/true);
    } else {
      device = hddp::parseDeviceName(name, "--check-device");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp-probe: --check-device %s: %s\n", name.c_str(), e.what());
    return 2;
  }
  if (device.is_cpu()) {
    std::printf("%s: cpu answers\n", name.c_str());
    return 0;
  }
  if (device.index() >= cudaCount) {
    std::printf("%s: %s is not visible (%d CUDA device(s))\n", name.c_str(), device.str().c_str(),
                cudaCount);
    return 1;
  }
  try {
    at::Tensor t = at::ones({1024}, at::TensorOptions().device(device));
    const double sum = t.sum().item<double>();  // runs a kernel and waits for it
    std::printf("%s: %s answers (%g)\n", name.c_str(), device.str().c_str(), sum);
    return sum == 1024 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("%s: %s does not answer: %s\n", name.c_str(), device.str().c_str(), e.what());
    return 1;
  }
}

// --job DIR: an elastic job's record, and while it runs the step each slot reached
// (the progress.slot<s> marks in its commit folder).
int showJob(const std::string& dir, bool asJson) {
  hddp::jobrecord::Job job;
  try {
    job = hddp::jobrecord::read(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp-probe: --job: %s\n", e.what());
    return 1;
  }
  json reached = json::object();
  const std::string commits = job.generations.empty() ? "" : job.generations.back().commits;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(commits, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("progress.slot", 0) == 0) {
      std::ifstream in(entry.path(), std::ios::binary);
      long long mark[2] = {0, -1};  // the Trainer's mark: job, step (src/train/elastic.cpp)
      if (in.read(reinterpret_cast<char*>(mark), sizeof(mark))) {
        reached[name.substr(13)] = mark[1];
      }
    }
  }
  if (asJson) {
    json out = hddp::jobrecord::toJson(job);
    out["folder"] = dir;
    out["step_reached_by_slot"] = reached;
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  std::printf("%s\n", dir.c_str());
  for (const auto& line : hddp::jobrecord::describe(job, hddp::jobrecord::unixNow())) {
    std::printf("%s\n", line.c_str());
  }
  if (!job.ended && !reached.empty()) {
    std::string text;
    for (auto it = reached.begin(); it != reached.end(); ++it) {
      text += (text.empty() ? "" : ", ") + std::string("slot ") + it.key() + " " +
              std::to_string(it.value().get<long long>());
    }
    std::printf("steps reached: %s\n", text.c_str());
  }
  return 0;
}

}  // namespace

int run(int argc, char** argv) {
  ProbeOptions o;
  CLI::App app{
      "hddp-probe: devices, links, eGPUs, bandwidth, versions, advice, and the batch split hddp "
      "would use"};
  app.add_option("--global-batch", o.globalBatch, "Global batch to split")->capture_default_str();
  app.add_option("--sample-bytes", o.sampleBytes, "Input bytes per sample moved to the device")
      ->capture_default_str();
  app.add_option("--sample-mib", o.sampleMiB,
                 "Device memory per sample (MiB: activations and workspace) for the memory "
                 "cap; 0 = no cap")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--fixed-mib", o.fixedMiB,
                 "Device memory a step holds whatever the batch (MiB: parameters, gradients, "
                 "optimizer state), for the memory cap")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--memory-headroom", o.headroom,
                 "Fraction of each device's memory kept free in the memory cap (the Trainer's "
                 "default)")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  app.add_option("--param-bytes", o.paramBytes,
                 "Gradient bytes per step (the model's parameters), for the allreduce term")
      ->capture_default_str();
  app.add_option("--cpu-ranks", o.cpuRanks, "Without CUDA: CPU ranks to plan for")
      ->capture_default_str();
  app.add_option("--sysfs", o.sysfs, "sysfs root (for fixtures)")->capture_default_str();
  app.add_flag("--json", o.asJson, "Machine-readable output");
  app.add_flag("--no-bandwidth", o.skipBandwidth, "Skip the bandwidth measurement");
  std::string checkDevice;
  app.add_option("--check-device", checkDevice,
                 "Only check that a device answers (exit 0) or not (exit 1): cpu, cuda:N, or "
                 "slot:N for the device a rank of hddp-run's slot N takes (HDDP_DEVICE, else "
                 "cuda:N with CUDA, else cpu); hddp-run's rejoin check");
  std::string jobDir;
  app.add_option("--job", jobDir,
                 "Only show an elastic job (hddp-run --nproc-per-node MIN:MAX): its generations, "
                 "the slots that left and came back, steps trained again, re-forming times, the "
                 "newest commit; DIR is the folder hddp-run names (or its --job-dir)");
  hddp_probe::WhatIfOptions w;
  hddp_probe::addWhatIfOptions(app, w);
  CLI11_PARSE(app, argc, argv);
  hddp::log::setLevel(hddp::log::Level::Warn);
  if (!w.spec.empty() || w.listDevices) {
    w.settings.globalBatch = o.globalBatch;
    w.settings.memoryHeadroom = o.headroom;
    w.json = o.asJson;
    return hddp_probe::runWhatIf(w);
  }
  if (!checkDevice.empty()) {
    return checkDeviceAnswers(checkDevice);
  }
  if (!jobDir.empty()) {
    return showJob(jobDir, o.asJson);
  }

  installEmulatorIfAsked();
  const bool hasCuda = at::detail::getCUDAHooks().hasCUDA();
  json out;
  out["versions"] = versions(hasCuda);
  hddp::TopologyOptions topo;
  topo.sysfsRoot = o.sysfs;
  const auto devices = hddp::probeDevices(topo);
  std::vector<std::string> advice;
  const json devs = describeDevices(devices, o, hasCuda, advice);
  out["devices"] = devs;
  const auto emulated = std::count_if(devices.begin(), devices.end(), [](const auto& d) {
    return d.device.type() == c10::DeviceType::PrivateUse1;
  });
  if (!hasCuda) {
    advice.push_back(
        "no CUDA device is visible: check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES, and that "
        "this LibTorch is a CUDA build; planning for " +
        std::string(emulated > 0 ? "the " + c10::get_privateuse1_backend() + " devices"
                                 : "CPU ranks"));
  }
  if (emulated > 0 && c10::get_privateuse1_backend() == "emu") {
    advice.push_back("hddp::emu is on (HDDP_EMU_DEVICES / HDDP_DEVICE): " +
                     std::to_string(emulated) +
                     " emulated device(s) computing on this CPU, at its speed times any "
                     "HDDP_EMU_SLOWDOWN factor; for tests and demos, not a GPU");
  }
  const ProbePlan p = planSplit(devices, devs, o);
  out["plan"] = {{"global_batch", o.globalBatch},
                 {"ranks", p.ranks},
                 {"predicted_step_s", p.plan.predictedStepSeconds},
                 {"equal_split_predicted_step_s", hddp::predictedSeconds(p.costs, p.equal.local)},
                 {"slowest_link_GBps", p.slowestLinkBytesPerSecond / 1e9},
                 {"allreduce_s", p.allreduceSeconds}};
  json env = json::array();
  for (const auto& s : hddp::env::describe()) {
    env.push_back({{"name", s.name}, {"value", s.value}, {"set_by", s.setBy}});
  }
  out["environment"] = env;
  out["advice"] = advice;
  if (o.asJson) {
    std::cout << out.dump(1) << "\n";
  } else {
    printReport(out, devices, devs, p, o, advice);
  }
  return 0;
}
