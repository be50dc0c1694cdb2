// PCIe links and eGPU detection from sysfs. Plain file reads: testable on fixture trees.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "hddp/topology/topology.h"

namespace hddp {
namespace fs = std::filesystem;

namespace {

std::string readLine(const fs::path& p) {
  std::ifstream in(p);
  std::string s;
  std::getline(in, s);
  return s;
}

bool isPciAddress(const std::string& s) {
  static const std::regex re("[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\\.[0-7]");
  return std::regex_match(s, re);
}

// The device's folder and those of its PCI ancestors, device first.
std::vector<fs::path> pciChain(const std::string& sysfsRoot, const std::string& address) {
  std::vector<fs::path> chain;
  std::error_code ec;
  fs::path dev = fs::canonical(fs::path(sysfsRoot) / "bus/pci/devices" / address, ec);
  if (ec) {
    return chain;
  }
  for (fs::path p = dev; !p.empty() && p != p.root_path(); p = p.parent_path()) {
    if (!isPciAddress(p.filename().string())) {
      break;
    }
    chain.push_back(p);
  }
  return chain;
}

// Intel Thunderbolt 3/4 and USB4 PCIe bridge device ids (upstream/downstream ports).
bool isThunderboltBridge(const std::string& vendor, const std::string& device) {
  if (vendor != "0x8086") {
    return false;
  }
  static const char* ids[] = {"0x1513", "0x151a", "0x151b", "0x1549", "0x1567", "0x1569",
                              "0x156b", "0x156d", "0x1576", "0x1578", "0x15b6", "0x15c0",
                              "0x15d3", "0x15da", "0x15e7", "0x15ea", "0x15ef", "0x1133",
                              "0x1136", "0x0b26", "0x5786", "0x57a4"};
  return std::find(std::begin(ids), std::end(ids), device) != std::end(ids);
}

}  // namespace

double pcieGBps(int generation, int width) {
  // Per lane, per direction, after 8b/10b (Gen1-2) or 128b/130b (Gen3+) coding.
  static const double perLane[] = {0.0, 0.25, 0.5, 0.985, 1.969, 3.938, 7.563};
  if (generation < 1 || generation > 6 || width <= 0) {
    return 0.0;
  }
  return perLane[generation] * width;
}

int pcieGenerationFromSpeed(const std::string& speed) {
  const double gts = std::atof(speed.c_str());
  if (gts >= 60) return 6;
  if (gts >= 30) return 5;
  if (gts >= 15) return 4;
  if (gts >= 7.5) return 3;
  if (gts >= 4.5) return 2;
  if (gts >= 2) return 1;
  return 0;
}

double PcieLink::currentGBps() const { return pcieGBps(currentGen, currentWidth); }
double PcieLink::maxGBps() const { return pcieGBps(maxGen, maxWidth); }

std::optional<PcieLink> readPcieLink(const std::string& sysfsRoot, const std::string& address) {
  const auto chain = pciChain(sysfsRoot, address);
  if (chain.empty()) {
    return std::nullopt;
  }
  PcieLink link;
  bool any = false;
  double best = -1;
  for (size_t i = 0; i < chain.size(); ++i) {
    const auto& hop = chain[i];
    const int gen = pcieGenerationFromSpeed(readLine(hop / "current_link_speed"));
    const int width = std::atoi(readLine(hop / "current_link_width").c_str());
    if (gen == 0 || width == 0) {
      continue;  // e.g. a root port without link attributes
    }
    if (i == 0) {
      link.maxGen = pcieGenerationFromSpeed(readLine(hop / "max_link_speed"));
      link.maxWidth = std::atoi(readLine(hop / "max_link_width").c_str());
    }
    const double gbps = pcieGBps(gen, width);
    if (!any || gbps < best) {
      best = gbps;
      link.currentGen = gen;
      link.currentWidth = width;
      link.limitingHop = hop.filename().string();
      any = true;
    }
  }
  if (!any) {
    return std::nullopt;
  }
  return link;
}

std::optional<std::string> externalReason(const std::string& sysfsRoot,
                                          const std::string& address) {
  for (const auto& hop : pciChain(sysfsRoot, address)) {
    const std::string name = hop.filename().string();
    if (readLine(hop / "removable") == "removable") {
      return "behind removable port " + name;
    }
    if (isThunderboltBridge(readLine(hop / "vendor"), readLine(hop / "device"))) {
      return "behind Thunderbolt/USB4 bridge " + name;
    }
  }
  return std::nullopt;
}

}  // namespace hddp
