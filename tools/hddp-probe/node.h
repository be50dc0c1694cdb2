// hddp-probe's report of this node: its devices (CUDA, a PrivateUse1 backend such as
// hddp::emu, the CPU), their links and bandwidth, a calibration per device, and the split
// of a global batch hddp's seed rule would start from (hddp/balance/seed.h).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/topology/topology.h"

namespace hddp_probe {

using json = nlohmann::json;

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

// The split hddp would use: one rank per accelerator (CUDA or PrivateUse1; else
// o.cpuRanks CPU ranks), each calibrated once per device, with links and memory caps.
struct ProbePlan {
  std::vector<c10::Device> rankDevices;
  std::vector<hddp::RankCost> costs;
  hddp::BatchPlan plan;
  hddp::BatchPlan equal;
  json ranks;
  double slowestLinkBytesPerSecond = 0.0;
  double allreduceSeconds = 0.0;  // ring allreduce of --param-bytes over the slowest link
};

/// Installs hddp::emu when HDDP_EMU_DEVICES is set or HDDP_DEVICE (or `deviceName`) names
/// emu, so that the emulated devices are listed and planned for as a training job would
/// see them; not where CUDA devices are visible (emu would take over pinned host memory),
/// which the returned advice says (empty otherwise).
std::string installEmulatorIfAsked(const std::string& deviceName = "");

/// hddp's, LibTorch's, CUDA's, cuDNN's and NCCL's versions.
json versions(bool hasCuda);

/// Each device as JSON: properties, link, eGPU, measured bandwidth; advice on the way.
json describeDevices(const std::vector<hddp::DeviceInfo>& devices, const ProbeOptions& o,
                     bool hasCuda, std::vector<std::string>& advice);

/// The split hddp would use (see ProbePlan).
ProbePlan planSplit(const std::vector<hddp::DeviceInfo>& devices, const json& devs,
                    const ProbeOptions& o);

/// The human-readable report (--json prints `out` instead).
void printReport(const json& out, const std::vector<hddp::DeviceInfo>& devices, const json& devs,
                 const ProbePlan& p, const ProbeOptions& o, const std::vector<std::string>& advice);

}  // namespace hddp_probe
