#include "hddp/balance/emulation.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <thread>

#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

double parseRankValue(const std::string& variable, const std::string& text, int rank,
                      double fallback) {
  if (text.empty()) {
    return fallback;
  }
  if (text.find(':') == std::string::npos) {
    return env::parseFloat(variable, text);
  }
  std::stringstream items(text);
  std::string item;
  double value = fallback;
  while (std::getline(items, item, ',')) {
    const auto colon = item.find(':');
    HDDP_CHECK_AS(ConfigError, colon != std::string::npos, variable, "='", text, "': item '", item,
                  "' is not rank:value (e.g. 1:3 or 0:1,1:2.5)");
    if (env::parseInt(variable, item.substr(0, colon)) == rank) {
      value = env::parseFloat(variable, item.substr(colon + 1));
    }
  }
  return value;
}

EmulationOptions emulationFromEnv(int rank) {
  EmulationOptions o;
  o.slowdown =
      parseRankValue("HDDP_EMULATE_SLOWDOWN", env::getString("HDDP_EMULATE_SLOWDOWN"), rank, 1.0);
  o.linkBytesPerSecond = parseRankValue("HDDP_EMULATE_LINK_GBPS",
                                        env::getString("HDDP_EMULATE_LINK_GBPS"), rank, 0.0) *
                         1e9;
  const double cap =
      parseRankValue("HDDP_EMULATE_MEMORY_CAP", env::getString("HDDP_EMULATE_MEMORY_CAP"), rank, 0);
  HDDP_CHECK_AS(ConfigError, cap >= 0 && cap == static_cast<double>(static_cast<int64_t>(cap)),
                "HDDP_EMULATE_MEMORY_CAP for rank ", rank, " is ", cap,
                "; a memory cap is a whole number of samples (0 = off)");
  o.memoryCapSamples = static_cast<int64_t>(cap);
  HDDP_CHECK_AS(ConfigError, o.slowdown >= 1.0, "HDDP_EMULATE_SLOWDOWN for rank ", rank, " is ",
                o.slowdown, "; a slowdown factor must be >= 1");
  HDDP_CHECK_AS(ConfigError, o.linkBytesPerSecond >= 0, "HDDP_EMULATE_LINK_GBPS for rank ", rank,
                " is negative");
  return o;
}

Emulator::Emulator(EmulationOptions options, int rank, Sleep sleep)
    : options_(options), sleep_(std::move(sleep)) {
  if (!sleep_) {
    sleep_ = [](std::chrono::duration<double> d) { std::this_thread::sleep_for(d); };
  }
  if (options_.active()) {
    HDDP_LOG_WARN("balance", "EMULATION ON for rank ", rank, ": compute x", options_.slowdown,
                  options_.linkBytesPerSecond > 0
                      ? c10::str(", link ", options_.linkBytesPerSecond / 1e9, " GB/s")
                      : std::string(),
                  options_.memoryCapSamples > 0
                      ? c10::str(", out of memory above ", options_.memoryCapSamples, " samples")
                      : std::string(),
                  " (for tests and demos; unset HDDP_EMULATE_* to turn it off)");
  }
}

void Emulator::checkMemory(int64_t samples) const {
  if (options_.memoryCapSamples > 0 && samples > options_.memoryCapSamples) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "emulated out of memory: ", samples,
                     " samples in a step, above the emulated cap of ", options_.memoryCapSamples,
                     " (HDDP_EMULATE_MEMORY_CAP / --emulate-memory-cap)");
  }
}

double Emulator::apply(double computeSeconds, int64_t bytesMoved) {
  if (!options_.active()) {
    return computeSeconds;
  }
  double extra = (options_.slowdown - 1.0) * computeSeconds;
  if (options_.linkBytesPerSecond > 0 && bytesMoved > 0) {
    extra += static_cast<double>(bytesMoved) / options_.linkBytesPerSecond;
  }
  if (extra > 0) {
    sleep_(std::chrono::duration<double>(extra));
  }
  return computeSeconds + extra;
}

}  // namespace hddp
