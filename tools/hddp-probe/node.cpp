#include "node.h"

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <stdexcept>

#include "hddp/hddp.h"
#ifdef HDDP_PROBE_WITH_EMU
#include "hddp/emu/emu.h"
#endif

namespace hddp_probe {
namespace {

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

// The device's free memory now (its total minus what every process holds on it); -1
// when unknown (the CPU, an allocator without memory figures).
int64_t freeBytes(const c10::Device& device) {
  if (device.is_cpu()) {
    return -1;
  }
  auto* allocator = dynamic_cast<c10::DeviceAllocator*>(c10::GetAllocator(device.type()));
  if (allocator == nullptr) {
    return -1;
  }
  try {
    return static_cast<int64_t>(allocator->getMemoryInfo(device.index()).first);
  } catch (const c10::Error&) {
    return -1;
  }
}

std::string freeText(const c10::Device& device);

// Whether a device is an accelerator hddp-probe plans a rank for: a CUDA device, or one
// of a PrivateUse1 backend (hddp::emu).
bool isAccelerator(const c10::Device& device) {
  return device.is_cuda() || device.type() == c10::DeviceType::PrivateUse1;
}

}  // namespace

std::string installEmulatorIfAsked(const std::string& deviceName) {
  const char* count = std::getenv("HDDP_EMU_DEVICES");
  const char* device = std::getenv("HDDP_DEVICE");
  std::string text = std::string(device ? device : "") + "," + deviceName;
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const bool named = text.rfind("emu", 0) == 0 || text.find(",emu") != std::string::npos;
  if (!(count && *count) && !named) {
    return "";
  }
  if (at::detail::getCUDAHooks().hasCUDA()) {
    // Installed, emu would become LibTorch's accelerator and pin host memory for itself:
    // the CUDA devices' pinned bandwidth would be measured from emu's memory.
    return "HDDP_EMU_DEVICES / HDDP_DEVICE ask for hddp::emu, but CUDA devices are visible: "
           "emu is not installed next to them (it would take over pinned host memory)";
  }
#ifdef HDDP_PROBE_WITH_EMU
  hddp::emu::install();
  return "";
#else
  throw std::runtime_error(
      "HDDP_EMU_DEVICES or HDDP_DEVICE asks for hddp::emu, but this build has none "
      "(configure with -DHDDP_BUILD_EMU=ON)");
#endif
}

namespace {

std::string gib(int64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  return b;
}

}  // namespace

namespace {

// " (2.0 GiB free)", or nothing when unknown.
std::string freeText(const c10::Device& device) {
  const int64_t free = freeBytes(device);
  return free < 0 ? std::string() : " (" + gib(free) + " free)";
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
      if (freeBytes(d.device) >= 0) {
        j["free_bytes"] = freeBytes(d.device);
      }
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
              freeBytes(dev) < 0 ? 0 : static_cast<double>(d.memoryBytes - freeBytes(dev));
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
      std::printf("%s, %d SMs, sm_%d%d, %s", freeText(d.device).c_str(), d.smCount, d.computeMajor,
                  d.computeMinor, d.pciBusId.c_str());
      if (d.link) {
        std::printf(", PCIe Gen%d x%d (max Gen%d x%d, %.1f GB/s)", d.link->currentGen,
                    d.link->currentWidth, d.link->maxGen, d.link->maxWidth, d.link->currentGBps());
      }
      if (d.external) std::printf(", eGPU: %s", d.external->c_str());
    } else if (isAccelerator(d.device)) {
      std::printf("%s", freeText(d.device).c_str());
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

}  // namespace hddp_probe
