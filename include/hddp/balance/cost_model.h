// A rank's device and link turned into the planner's cost (hddp/balance/batch_plan.h):
// the one function the Trainer seeds its planner with and hddp-probe reports from.
//
//   link bandwidth     emulated (HDDP_EMULATE_LINK_GBPS) > measured pinned host-to-device
//                      copies > the PCIe link's nominal rate (generation x width, from
//                      sysfs) > none (a CPU rank: its input is already in its memory)
//   transfer / sample  input bytes per sample / link bandwidth
//   overlap            a device rank's loader copies on a side stream while it computes:
//                      the step pays max(compute, transfer) per sample, else the sum
//   compute / sample   a calibration when one was made (0 = unknown), stretched by an
//                      emulated slowdown
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "hddp/balance/batch_plan.h"
#include "hddp/topology/topology.h"

namespace hddp {

/// What a rank knows of its device and link before it has trained a step.
struct RankProfile {
  c10::Device device = c10::Device(c10::kCPU);
  /// The device's PCIe link from sysfs; nullopt when unknown (or a CPU rank).
  std::optional<PcieLink> link;
  /// Why the device looks external (an eGPU), when it does.
  std::optional<std::string> external;
  /// Measured host-to-device copy bandwidth from pinned memory, bytes/s; 0 = not measured.
  double measuredBytesPerSecond = 0.0;
  /// Input bytes per sample (what the loader moves to the device).
  double bytesPerSample = 0.0;
  /// Compute seconds per sample from a calibration; 0 = unknown.
  double computeSecondsPerSample = 0.0;
  /// Input copies overlap compute (a prefetching loader on a side stream).
  bool transferOverlapped = false;
  int64_t maxSamples = std::numeric_limits<int64_t>::max();
  /// Emulation (tests, demos): a link of this many bytes/s replaces the real one (0 =
  /// off), and compute is stretched by this factor.
  double emulatedLinkBytesPerSecond = 0.0;
  double emulatedSlowdown = 1.0;
};

/// The link bandwidth the planner uses for `profile` (see the table above), bytes/s;
/// 0 = no link term.
double planningLinkBytesPerSecond(const RankProfile& profile);

/// Where that bandwidth came from: "emulated", "measured", "PCIe Gen3 x4 (nominal)",
/// "none".
std::string linkSource(const RankProfile& profile);

/// The planner's cost for `profile`.
RankCost costOf(const RankProfile& profile);

/// Seconds a ring allreduce of `bytes` over `ranks` ranks takes when its slowest link
/// carries `slowestBytesPerSecond`: each rank sends and receives 2 (n-1)/n of the
/// bytes. No split of the batch changes it; with gradients bucketed during backward,
/// part of it hides behind compute (the exposed rest is measured per step). 0 for one
/// rank or no link.
double ringAllreduceSeconds(double bytes, int ranks, double slowestBytesPerSecond);

/// Probes this process's `device`: its PCIe link and eGPU flag (sysfs), and, when
/// `measureLink` and the device is not the CPU, pinned host-to-device bandwidth (a few
/// 16 MiB copies, ~0.1 s). `bytesPerSample` is the input the loader moves per sample.
RankProfile profileOf(const c10::Device& device, double bytesPerSample, bool measureLink,
                      const TopologyOptions& topology = {});

}  // namespace hddp
