// hddp-probe --what-if's output (what_if_report.h): the prediction as a table, as JSON and
// as an SVG chart of each device's step, and --list-devices' table of cards and links.
#include "what_if_report.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>

namespace hddp_probe {
namespace {

using json = nlohmann::json;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

std::string fixed(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.*f", digits, v);
  return b;
}

std::string capText(int64_t cap) {
  return cap == std::numeric_limits<int64_t>::max() ? "-" : std::to_string(cap);
}

json costJson(const hddp::CompressionCost& c) {
  return {{"choice", c.spec.name()},
          {"wire_bytes", c.wireBytes},
          {"allreduces", c.messages},
          {"allreduce_s", c.allreduceSeconds},
          {"compute_s", c.computeSeconds},
          {"exposed_s", c.exposedSeconds},
          {"hidden", c.hidden}};
}

json compressionJson(const hddp::WhatIfResult& r) {
  json j = costJson(r.compression);
  if (!r.compressionCandidates.empty()) {
    j["candidates"] = json::array();
    for (const auto& c : r.compressionCandidates) {
      j["candidates"].push_back(costJson(c));
    }
    j["why"] = r.compressionWhy;
  }
  return j;
}

}  // namespace

json toJson(const hddp::WhatIfResult& r, const hddp::ModelProfile& p, const WhatIfOptions& o) {
  json devices = json::array();
  for (const auto& d : r.devices) {
    devices.push_back(
        {{"device", d.entry.device.key},
         {"name", d.entry.device.name},
         {"link", d.entry.link.key},
         {"link_GBps", d.entry.link.GBps},
         {"peak_tflops", d.peakTflops},
         {"local_batch", d.local},
         {"memory_cap",
          d.memoryCap == std::numeric_limits<int64_t>::max() ? json(nullptr) : json(d.memoryCap)},
         {"compute_s_per_sample", d.cost.secondsPerSample},
         {"transfer_s_per_sample", d.cost.transferSecondsPerSample()},
         {"fixed_s", d.cost.fixedSeconds},
         {"compute_s", d.computeSeconds},
         {"transfer_s", d.transferSeconds},
         {"step_s", d.stepSeconds},
         {"memory_bytes", d.memoryBytes},
         {"parameter_bytes", d.parameterBytes},
         {"gradient_bytes", d.gradientBytes},
         {"state_bytes", d.stateBytes},
         {"activation_bytes", d.activationBytes},
         {"share_of_state", d.shareOfState}});
  }
  return {
      {"model", json::parse(p.toJson())},
      {"global_batch", o.settings.globalBatch},
      {"efficiency", p.calibratedOn.empty() ? json(o.settings.efficiency) : json(nullptr)},
      {"memory_traffic", p.calibratedOn.empty() ? json(o.settings.memoryTraffic) : json(nullptr)},
      {"uncertainty", p.calibratedOn.empty() ? json(o.settings.uncertainty) : json(nullptr)},
      {"zero", o.settings.zero},
      {"shard_by", o.settings.zero > 0 ? json(o.settings.shardBy) : json(nullptr)},
      {"devices", devices},
      {"split", r.plan.local},
      {"compression", compressionJson(r)},
      {"allreduce_s", r.allreduceSeconds},
      {"exposed_allreduce_s", r.exposedAllreduceSeconds},
      {"slowest_link_GBps", r.slowestLinkGBps},
      {"step_s", r.stepSeconds},
      {"samples_per_s", r.samplesPerSecond},
      {"equal_split_samples_per_s",
       r.equalSplitSamplesPerSecond > 0 ? json(r.equalSplitSamplesPerSecond) : json(nullptr)},
      {"fastest_alone",
       {{"device", r.devices[static_cast<size_t>(r.fastest)].entry.device.key},
        {"samples_per_s", r.fastestAloneSamplesPerSecond}}},
      {"advice", r.advice}};
}

void printTable(const hddp::WhatIfResult& r, const hddp::ModelProfile& p, const WhatIfOptions& o) {
  std::string mix;
  for (const auto& d : r.devices) {
    mix += (mix.empty() ? "" : " + ") + d.entry.device.key + " on " + d.entry.link.key;
  }
  std::printf("What if: %s, global batch %lld\n", mix.c_str(),
              static_cast<long long>(o.settings.globalBatch));
  std::printf(
      "Model: %s, %s: %.2f GFLOPs/sample to train (%.2f forward), %.1f M parameters "
      "(%.1f MiB), %.2f MiB activations/sample, %.1f KiB input/sample\n",
      p.model.c_str(), p.amp == hddp::AmpMode::Off ? "fp32" : hddp::ampModeName(p.amp),
      p.trainFlopsPerSample / 1e9, p.forwardFlopsPerSample / 1e9, p.parameterBytes / 4e6,
      p.parameterBytes / kMiB, p.activationBytesPerSample / kMiB, p.inputBytesPerSample / 1024.0);
  if (p.calibratedOn.empty()) {
    std::printf(
        "Compute: %.0f%% of each card's peak + %.1f bytes of memory traffic per activation "
        "byte (not calibrated: +/-%.0f%%, the fit's largest error on published figures)\n\n",
        100.0 * o.settings.efficiency, o.settings.memoryTraffic, 100.0 * o.settings.uncertainty);
  } else {
    std::printf(
        "Compute: calibrated on %s, %.3f ms/sample + %.2f ms a step, scaled by peak "
        "ratios\n\n",
        p.calibratedOn.c_str(), p.calibratedSecondsPerSample * 1e3, p.calibratedFixedSeconds * 1e3);
  }
  std::printf("  %-10s %-9s %7s %6s %7s %11s %9s %8s %10s\n", "device", "link", "TFLOPS", "batch",
              "mem cap", "compute ms", "input ms", "step ms", "memory GiB");
  for (const auto& d : r.devices) {
    std::printf("  %-10s %-9s %7.1f %6lld %7s %11.2f %9.2f %8.2f %10.2f\n",
                d.entry.device.key.c_str(), d.entry.link.key.c_str(), d.peakTflops,
                static_cast<long long>(d.local), capText(d.memoryCap).c_str(),
                d.computeSeconds * 1e3, d.transferSeconds * 1e3, d.stepSeconds * 1e3,
                d.memoryBytes / kGiB);
  }
  if (o.settings.zero > 0) {
    // What ZeRO leaves on each card, by part (see the header of hddp/balance/what_if.h).
    std::printf("  ZeRO-%d, shards by %s (GiB):\n", o.settings.zero, o.settings.shardBy.c_str());
    std::printf("  %-10s %10s %10s %10s %11s %7s\n", "device", "parameters", "gradients", "state",
                "activations", "share");
    for (const auto& d : r.devices) {
      std::printf("  %-10s %10.2f %10.2f %10.2f %11.2f %6.1f%%\n", d.entry.device.key.c_str(),
                  d.parameterBytes / kGiB, d.gradientBytes / kGiB, d.stateBytes / kGiB,
                  d.activationBytes / kGiB, 100.0 * d.shareOfState);
    }
  }
  if (r.allreduceSeconds > 0 && r.compression.spec.kind == hddp::CompressionSpec::Kind::None) {
    std::printf(
        "  allreduce: %.1f MB of gradients over the slowest link (%.1f GB/s, ring): "
        "%.2f ms, %.2f ms exposed after backward\n",
        p.parameterBytes / 1e6, r.slowestLinkGBps, r.allreduceSeconds * 1e3,
        r.exposedAllreduceSeconds * 1e3);
  } else if (r.allreduceSeconds > 0) {
    std::printf(
        "  allreduce: %.1f MB of gradients (%.3g MB on the wire, %s) over the slowest link "
        "(%.1f GB/s, ring): %.2f ms, %.2f ms exposed after backward",
        p.parameterBytes / 1e6, r.compression.wireBytes / 1e6, r.compression.spec.name().c_str(),
        r.slowestLinkGBps, r.allreduceSeconds * 1e3,
        (r.exposedAllreduceSeconds - r.compression.computeSeconds) * 1e3);
    if (r.compression.computeSeconds > 0) {
      std::printf(", %.2f ms of compression compute", r.compression.computeSeconds * 1e3);
    }
    std::printf("\n");
  }
  for (const auto& c : r.compressionCandidates) {
    std::printf("  --compress %s\n", c.describe().c_str());
  }
  std::printf("  predicted: %.2f ms a step, %.0f samples/s", r.stepSeconds * 1e3,
              r.samplesPerSecond);
  if (p.calibratedOn.empty()) {
    std::printf(" (+/-%.0f%%, not calibrated)", 100.0 * o.settings.uncertainty);
  }
  if (r.devices.size() > 1) {
    if (r.equalSplitSamplesPerSecond > 0) {
      std::printf("; equal split (PyTorch DDP) %.0f samples/s", r.equalSplitSamplesPerSecond);
    } else {
      std::printf("; equal split (PyTorch DDP) out of memory");
    }
    std::printf("; %s alone %.0f samples/s",
                r.devices[static_cast<size_t>(r.fastest)].entry.device.key.c_str(),
                r.fastestAloneSamplesPerSecond);
  }
  std::printf("\n\nAdvice\n");
  for (const auto& a : r.advice) {
    std::printf("  - %s\n", a.c_str());
  }
}

// Per-device time of a step as stacked bars: fixed, compute, input copies not hidden,
// waiting for the slowest, and the exposed allreduce.
std::string svgChart(const hddp::WhatIfResult& r, const hddp::ModelProfile& p) {
  const double total = r.stepSeconds;
  const int left = 170, width = 560, barHeight = 26, gap = 14, top = 48;
  const int height = top + static_cast<int>(r.devices.size()) * (barHeight + gap) + 70;
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 30 << "\" height=\""
    << height << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"10\" y=\"20\" font-size=\"14\">" << p.model << ": "
    << fixed(r.samplesPerSecond, 0) << " samples/s predicted, " << fixed(total * 1e3, 1)
    << " ms a step</text>\n";
  const struct {
    const char* name;
    const char* colour;
  } parts[] = {{"fixed", "#9e9e9e"},
               {"compute", "#1f77b4"},
               {"input not hidden", "#ff7f0e"},
               {"waiting", "#e8e8e8"},
               {"allreduce exposed", "#d62728"}};
  double slowest = 0.0;
  for (const auto& d : r.devices) {
    slowest = std::max(slowest, d.stepSeconds);
  }
  for (size_t i = 0; i < r.devices.size(); ++i) {
    const auto& d = r.devices[i];
    const double hidden =
        d.cost.transferOverlapped ? std::min(d.transferSeconds, d.computeSeconds) : 0.0;
    const double seconds[] = {d.cost.fixedSeconds, d.computeSeconds, d.transferSeconds - hidden,
                              slowest - d.stepSeconds, r.exposedAllreduceSeconds};
    const int y = top + static_cast<int>(i) * (barHeight + gap);
    s << "<text x=\"10\" y=\"" << y + 17 << "\">" << d.entry.device.key << " @ " << d.entry.link.key
      << " (" << d.local << ")</text>\n";
    double x = left;
    for (size_t k = 0; k < 5; ++k) {
      const double w = total > 0 ? std::max(0.0, seconds[k]) / total * width : 0.0;
      if (w > 0) {
        s << "<rect x=\"" << fixed(x, 1) << "\" y=\"" << y << "\" width=\"" << fixed(w, 1)
          << "\" height=\"" << barHeight << "\" fill=\"" << parts[k].colour << "\"><title>"
          << parts[k].name << " " << fixed(seconds[k] * 1e3, 2) << " ms</title></rect>\n";
      }
      x += w;
    }
  }
  const int axis = top + static_cast<int>(r.devices.size()) * (barHeight + gap);
  s << "<line x1=\"" << left << "\" y1=\"" << axis << "\" x2=\"" << left + width << "\" y2=\""
    << axis << "\" stroke=\"black\"/>\n";
  for (int t = 0; t <= 4; ++t) {
    s << "<text x=\"" << left + width * t / 4 << "\" y=\"" << axis + 15
      << "\" text-anchor=\"middle\">" << fixed(total * 1e3 * t / 4, 1) << " ms</text>\n";
  }
  int x = 10;
  for (const auto& part : parts) {
    s << "<rect x=\"" << x << "\" y=\"" << axis + 30 << "\" width=\"12\" height=\"12\" fill=\""
      << part.colour << "\"/><text x=\"" << x + 16 << "\" y=\"" << axis + 40 << "\">" << part.name
      << "</text>\n";
    x += 30 + static_cast<int>(std::string(part.name).size()) * 7;
  }
  s << "</svg>\n";
  return s.str();
}

void listDevices(const hddp::DeviceTable& table) {
  std::printf("Devices (fp32 / fp16 / bf16 TFLOPS, memory, memory bandwidth)\n");
  for (const auto& [key, d] : table.devices()) {
    std::printf("  %-11s %-26s %6.1f / %6.1f / %6.1f  %5.0f GiB  %5.0f GB/s\n", key.c_str(),
                d.name.c_str(), d.fp32Tflops, d.fp16Tflops, d.bf16Tflops, d.memoryGiB,
                d.memoryGBps);
  }
  std::printf("Links (usable host-to-device bandwidth)\n");
  for (const auto& [key, l] : table.links()) {
    std::printf("  %-11s %-45s %5.1f GB/s\n", key.c_str(), l.name.c_str(), l.GBps);
  }
}

}  // namespace hddp_probe
