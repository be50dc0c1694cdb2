#include "hddp/topology/topology.h"

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "topology/cuda_properties.h"

namespace hddp {
namespace {

// NVML, loaded at run time (never linked): PCIe generation/width as the driver sees it.
class Nvml {
 public:
  Nvml() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!lib_) {
      return;
    }
    init_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"));
    byBus_ = reinterpret_cast<int (*)(const char*, void**)>(
        dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    for (int i = 0; i < 4; ++i) {
      static const char* names[] = {
          "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
          "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"};
      query_[i] = reinterpret_cast<int (*)(void*, unsigned*)>(dlsym(lib_, names[i]));
    }
    ok_ = init_ && byBus_ && query_[0] && query_[1] && query_[2] && query_[3] && init_() == 0;
  }
  ~Nvml() {
    if (ok_ && shutdown_) {
      shutdown_();
    }
    if (lib_) {
      dlclose(lib_);
    }
  }
  bool ok() const { return ok_; }
  std::optional<PcieLink> link(const std::string& busId) {
    void* dev = nullptr;
    if (!ok_ || byBus_(busId.c_str(), &dev) != 0) {
      return std::nullopt;
    }
    unsigned v[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; ++i) {
      if (query_[i](dev, &v[i]) != 0) {
        return std::nullopt;
      }
    }
    PcieLink l;
    l.currentGen = static_cast<int>(v[0]);
    l.currentWidth = static_cast<int>(v[1]);
    l.maxGen = static_cast<int>(v[2]);
    l.maxWidth = static_cast<int>(v[3]);
    l.limitingHop = busId + " (NVML)";
    return l;
  }

 private:
  void* lib_ = nullptr;
  bool ok_ = false;
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*byBus_)(const char*, void**) = nullptr;
  int (*query_[4])(void*, unsigned*) = {nullptr, nullptr, nullptr, nullptr};
};

std::string cpuName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      return line.substr(line.find(':') + 2);
    }
  }
  return "CPU";
}

}  // namespace

std::vector<DeviceInfo> probeDevices(const TopologyOptions& options) {
  std::vector<DeviceInfo> out;
  DeviceInfo cpu;
  cpu.name = cpuName();
  cpu.memoryBytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  cpu.smCount = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  out.push_back(cpu);
  const int n = detail::cudaDeviceCount();
  std::unique_ptr<Nvml> nvml;
  if (n > 0 && options.useNvml) {
    nvml = std::make_unique<Nvml>();
  }
  for (int i = 0; i < n; ++i) {
    DeviceInfo info = detail::cudaDeviceInfo(i);
    info.link = readPcieLink(options.sysfsRoot, info.pciBusId);
    if (nvml && nvml->ok()) {
      if (auto l = nvml->link(info.pciBusId)) {
        info.nvmlSeen = true;
        if (!info.link) {
          info.link = l;
        }
      }
    }
    info.external = externalReason(options.sysfsRoot, info.pciBusId);
    out.push_back(info);
  }
  // An accelerator registered as LibTorch's PrivateUse1 backend (hddp::emu, say): its
  // devices by its own count, memory from its device allocator when it has one.
  if (c10::is_privateuse1_backend_registered() &&
      c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) {
    const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
    const std::string backend = c10::get_privateuse1_backend(/*lower_case=*/true);
    const int count = static_cast<int>(guard->deviceCount());
    for (int i = 0; i < count; ++i) {
      DeviceInfo info;
      info.device = c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(i));
      info.name = backend + " (PrivateUse1 accelerator)";
      auto* allocator =
          dynamic_cast<c10::DeviceAllocator*>(c10::GetAllocator(c10::DeviceType::PrivateUse1));
      if (allocator != nullptr) {
        try {
          info.memoryBytes = static_cast<int64_t>(
              allocator->getMemoryInfo(static_cast<c10::DeviceIndex>(i)).second);
        } catch (const c10::Error&) {
          // an allocator without memory figures: the size stays unknown (0)
        }
      }
      out.push_back(info);
    }
  }
  return out;
}

Bandwidth measureBandwidth(const c10::Device& device, const BandwidthOptions& options) {
  const bool pinned = options.pinned;
  const int64_t bytes = options.bytes;
  const int repeats = options.repeats;
  HDDP_CHECK(bytes > 0 && repeats > 0, "measureBandwidth: ", bytes, " bytes, ", repeats,
             " repeats");
  using Clock = std::chrono::steady_clock;
  const auto hostOpts =
      at::TensorOptions().dtype(at::kByte).pinned_memory(pinned && device.is_cuda());
  at::Tensor host = at::empty({bytes}, hostOpts).fill_(1);
  at::Tensor back = at::empty({bytes}, hostOpts);
  at::Tensor dev = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  auto sync = [&] {
    if (device.is_cuda()) {
      torch::cuda::synchronize(device.index());
    }
  };
  double bestIn = 1e30;
  double bestOut = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {  // the first round warms up
    sync();
    auto t0 = Clock::now();
    dev.copy_(host, /*non_blocking=*/pinned);
    sync();
    auto t1 = Clock::now();
    back.copy_(dev, /*non_blocking=*/pinned);
    sync();
    auto t2 = Clock::now();
    if (r > 0) {
      bestIn = std::min(bestIn, std::chrono::duration<double>(t1 - t0).count());
      bestOut = std::min(bestOut, std::chrono::duration<double>(t2 - t1).count());
    }
  }
  Bandwidth bw;
  bw.pinned = pinned && device.is_cuda();
  bw.hostToDeviceGBps = static_cast<double>(bytes) / bestIn / 1e9;
  bw.deviceToHostGBps = static_cast<double>(bytes) / bestOut / 1e9;
  return bw;
}

Bf16Support cpuBf16Support(const std::string& cpuinfo) {
  std::istringstream lines(cpuinfo);
  for (std::string line; std::getline(lines, line);) {
    const auto colon = line.find(':');
    const std::string key = line.substr(0, line.find_first_of(" \t:"));
    if (colon == std::string::npos || (key != "flags" && key != "Features")) {
      continue;
    }
    std::istringstream flags(line.substr(colon + 1));
    for (std::string flag; flags >> flag;) {
      if (flag == "avx512_bf16" || flag == "amx_bf16" || flag == "bf16") {
        return {true, flag};
      }
    }
    return {false, key == "flags" ? "no avx512_bf16 or amx_bf16 among the CPU's flags"
                                  : "no bf16 among the CPU's features"};
  }
  return {false, "no CPU flags found"};
}

Bf16Support bf16Support(const c10::Device& device) {
  if (device.is_cuda()) {
    const int index = device.has_index() ? device.index() : 0;
    if (index >= detail::cudaDeviceCount()) {
      return {false, "no such CUDA device"};
    }
    const DeviceInfo info = detail::cudaDeviceInfo(index);
    const std::string capability = "compute capability " + std::to_string(info.computeMajor) + "." +
                                   std::to_string(info.computeMinor);
    return {info.computeMajor >= 8, capability};
  }
  std::ifstream in("/proc/cpuinfo");
  std::stringstream text;
  text << in.rdbuf();
  return cpuBf16Support(text.str());
}

}  // namespace hddp
