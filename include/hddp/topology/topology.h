// What devices there are and how they are attached.
//
// CUDA cards: name, memory, SM count, compute capability, PCI bus id; their host link
// read from sysfs by walking from the card's PCI address up to the root port (the
// narrowest and slowest hop counts), whether the card sits behind a Thunderbolt/USB4
// bridge or a removable port (an eGPU), NVML's view when libnvidia-ml can be loaded
// (dlopen; never a hard dependency). The sysfs root is a parameter, so tests run on
// fixture trees. CPU ranks report memory as their "link".
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hddp {

struct PcieLink {
  int currentGen = 0;
  int currentWidth = 0;
  int maxGen = 0;
  int maxWidth = 0;
  /// The hop (PCI address) that limits the current link.
  std::string limitingHop;
  /// Usable bandwidth per direction of the current link in GB/s (after line coding).
  double currentGBps() const;
  double maxGBps() const;
  /// Running below what the card supports (e.g. x4 in an x16 card, Gen1 at idle).
  bool degraded() const { return currentGen < maxGen || currentWidth < maxWidth; }
};

/// GB/s per direction of a PCIe link: generation 1..6 and lane count.
double pcieGBps(int generation, int width);
/// "8.0 GT/s PCIe" -> 3; 0 when unknown.
int pcieGenerationFromSpeed(const std::string& sysfsSpeed);

/// The link of the PCI device `address` (e.g. "0000:01:00.0") under `sysfsRoot`.
std::optional<PcieLink> readPcieLink(const std::string& sysfsRoot, const std::string& address);

/// Why the device looks external (behind a Thunderbolt/USB4 bridge or a removable
/// port), or nullopt when it does not.
std::optional<std::string> externalReason(const std::string& sysfsRoot, const std::string& address);

struct DeviceInfo {
  c10::Device device = c10::Device(c10::kCPU);
  std::string name;
  int64_t memoryBytes = 0;
  int smCount = 0;
  int computeMajor = 0;
  int computeMinor = 0;
  std::string pciBusId;  // "0000:01:00.0"
  std::optional<PcieLink> link;
  std::optional<std::string> external;  // set for an eGPU: why
  bool nvmlSeen = false;
};

struct TopologyOptions {
  std::string sysfsRoot = "/sys";
  /// Load NVML (libnvidia-ml.so.1) if present. Default true.
  bool useNvml = true;
};

/// Whether a device computes bfloat16 natively, and why (for the log).
struct Bf16Support {
  bool native = false;
  std::string why;  // "avx512_bf16", "compute capability 9.0", "no avx512_bf16/amx_bf16", ...
};

/// A CPU from its /proc/cpuinfo text: native with avx512_bf16 or amx_bf16 (x86) or bf16
/// (Arm) among its flags. Without them oneDNN emulates bf16, measured 11x slower than
/// float32 for ResNet-20 on an AVX2-only EPYC.
Bf16Support cpuBf16Support(const std::string& cpuinfo);

/// `device`'s support: the CPU's from /proc/cpuinfo, a CUDA device's from its compute
/// capability (8.0 or later; 0 for a device that is not there).
Bf16Support bf16Support(const c10::Device& device);

/// The CPU and every visible CUDA device, with links from sysfs (and NVML).
std::vector<DeviceInfo> probeDevices(const TopologyOptions& options = {});

struct Bandwidth {
  double hostToDeviceGBps = 0;
  double deviceToHostGBps = 0;
  bool pinned = false;
};

struct BandwidthOptions {
  /// Page-locked host memory (what a prefetching loader copies from; CUDA only).
  /// Default false: pageable memory.
  bool pinned = false;
  /// Bytes per copy. Default 64 MiB.
  int64_t bytes = 64 << 20;
  /// The best of this many timed copies each way (after one warm-up). Default 5.
  int repeats = 5;
};

/// Measured copy bandwidth between host memory and `device`; for a CPU device,
/// memory-to-memory copy bandwidth.
Bandwidth measureBandwidth(const c10::Device& device, const BandwidthOptions& options = {});

}  // namespace hddp
