#include "hddp/balance/cost_model.h"

#include <algorithm>

#include "hddp/core/error.h"

namespace hddp {

double planningLinkBytesPerSecond(const RankProfile& p) {
  if (p.emulatedLinkBytesPerSecond > 0) {
    return p.emulatedLinkBytesPerSecond;
  }
  if (p.device.is_cpu()) {
    return 0.0;
  }
  if (p.measuredBytesPerSecond > 0) {
    return p.measuredBytesPerSecond;
  }
  if (p.link && p.link->currentGBps() > 0) {
    return p.link->currentGBps() * 1e9;
  }
  return 0.0;
}

std::string linkSource(const RankProfile& p) {
  if (p.emulatedLinkBytesPerSecond > 0) {
    return "emulated";
  }
  if (p.device.is_cpu()) {
    return "none";
  }
  if (p.measuredBytesPerSecond > 0) {
    return "measured";
  }
  if (p.link && p.link->currentGBps() > 0) {
    return "PCIe Gen" + std::to_string(p.link->currentGen) + " x" +
           std::to_string(p.link->currentWidth) + " (nominal)";
  }
  return "none";
}

RankCost costOf(const RankProfile& p) {
  HDDP_CHECK_AS(ConfigError,
                p.bytesPerSample >= 0 && p.computeSecondsPerSample >= 0 &&
                    p.emulatedSlowdown >= 1.0 && p.maxSamples >= 0,
                "costOf: invalid profile (", p.bytesPerSample, " B/sample, ",
                p.computeSecondsPerSample, " s/sample, slowdown ", p.emulatedSlowdown, ", cap ",
                p.maxSamples, ")");
  RankCost c;
  c.secondsPerSample = p.computeSecondsPerSample * p.emulatedSlowdown;
  c.bytesPerSample = p.bytesPerSample;
  c.linkBytesPerSecond = planningLinkBytesPerSecond(p);
  // An emulated link is slept after the step (serial); a device's real copies overlap.
  c.transferOverlapped = p.transferOverlapped && p.emulatedLinkBytesPerSecond <= 0;
  c.maxSamples = p.maxSamples;
  return c;
}

double ringAllreduceSeconds(double bytes, int ranks, double slowestBytesPerSecond) {
  if (ranks <= 1 || !(slowestBytesPerSecond > 0) || !(bytes > 0)) {
    return 0.0;
  }
  const double n = ranks;
  return 2.0 * (n - 1.0) / n * bytes / slowestBytesPerSecond;
}

RankProfile profileOf(const c10::Device& device, double bytesPerSample, bool measureLink,
                      const TopologyOptions& topology) {
  RankProfile p;
  p.device = device;
  p.bytesPerSample = bytesPerSample;
  if (device.is_cpu()) {
    return p;
  }
  TopologyOptions quiet = topology;
  for (const auto& d : probeDevices(quiet)) {
    if (d.device == device) {
      p.link = d.link;
      p.external = d.external;
    }
  }
  if (measureLink) {
    BandwidthOptions b;
    b.pinned = true;
    b.bytes = 16 << 20;
    b.repeats = 3;
    p.measuredBytesPerSecond = measureBandwidth(device, b).hostToDeviceGBps * 1e9;
  }
  return p;
}

}  // namespace hddp
