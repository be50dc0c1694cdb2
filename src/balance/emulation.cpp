#include "hddp/balance/emulation.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/core/step_timer.h"
#include "hddp_protocol/launch.h"

namespace hddp {

ListMembers listMembersFromEnv(int worldSize) {
  ListMembers m;
  // The launcher's convention (as HDDP_SLOT), not options of the registry.
  const char* slotsText = std::getenv(protocol::kEnvSlots);
  const std::string slots = slotsText ? slotsText : "";
  if (slots.empty()) {
    return m;
  }
  std::stringstream items(slots);
  std::string item;
  while (std::getline(items, item, ',')) {
    m.slotOfRank.push_back(static_cast<int>(env::parseInt("HDDP_SLOTS", item)));
  }
  const char* countText = std::getenv(protocol::kEnvSlotCount);
  const std::string count = countText ? countText : "";
  m.slotCount = count.empty() ? 0 : static_cast<int>(env::parseInt("HDDP_SLOT_COUNT", count));
  for (int s : m.slotOfRank) {
    m.slotCount = std::max(m.slotCount, s + 1);
  }
  HDDP_CHECK_AS(ConfigError, static_cast<int>(m.slotOfRank.size()) == worldSize, "HDDP_SLOTS='",
                slots, "' names ", m.slotOfRank.size(), " slot(s) for a job of ", worldSize,
                " rank(s) (hddp-run sets it in an elastic job)");
  return m;
}

namespace {

// The rank a list item's number names (-1: a slot not in this generation, ignored).
int rankOfItem(const std::string& variable, const std::string& text, const std::string& item,
               int64_t index, int worldSize, const ListMembers& members) {
  if (!members.bySlot()) {
    HDDP_CHECK_AS(ConfigError, index >= 0 && index < worldSize, variable, "='", text, "': item '",
                  item, "' names rank ", index, ", but this job has ", worldSize, " rank(s) (0..",
                  worldSize - 1, ")");
    return static_cast<int>(index);
  }
  HDDP_CHECK_AS(ConfigError, index >= 0 && index < members.slotCount, variable, "='", text,
                "': item '", item, "' names slot ", index, ", but this elastic job has ",
                members.slotCount, " slot(s) (0..", members.slotCount - 1,
                "; in an elastic job the items name slots)");
  for (size_t r = 0; r < members.slotOfRank.size(); ++r) {
    if (members.slotOfRank[r] == index) {
      return static_cast<int>(r);
    }
  }
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> lock(mu);
  if (said.insert(variable + "/" + std::to_string(index)).second) {
    HDDP_LOG_INFO("balance", variable, ": slot ", index,
                  " is not in this generation of the elastic job; its value '", item,
                  "' applies when it is back");
  }
  return -1;
}

}  // namespace

std::vector<double> parseRankValues(const std::string& variable, const std::string& text,
                                    int worldSize, double fallback) {
  HDDP_CHECK(worldSize >= 1, "parseRankValues: worldSize must be >= 1, got ", worldSize);
  std::vector<double> values(static_cast<size_t>(worldSize), fallback);
  if (text.empty()) {
    return values;
  }
  auto number = [&](const std::string& item, const std::string& valueText) {
    const double v = env::parseFloat(variable, valueText);
    HDDP_CHECK_AS(ConfigError, std::isfinite(v), variable, "='", text, "': item '", item,
                  "' is not a finite number");
    return v;
  };
  if (text.find(':') == std::string::npos) {
    std::fill(values.begin(), values.end(), number(text, text));
    return values;
  }
  const ListMembers members = listMembersFromEnv(worldSize);
  std::vector<bool> seen(static_cast<size_t>(worldSize), false);
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto colon = item.find(':');
    HDDP_CHECK_AS(ConfigError, colon != std::string::npos, variable, "='", text, "': item '", item,
                  "' is not rank:value (e.g. 1:3 or 0:1,1:2.5)");
    const int64_t index = env::parseInt(variable, item.substr(0, colon));
    const double value = number(item, item.substr(colon + 1));
    const int rank = rankOfItem(variable, text, item, index, worldSize, members);
    if (rank < 0) {
      continue;
    }
    HDDP_CHECK_AS(ConfigError, !seen[static_cast<size_t>(rank)], variable, "='", text,
                  "': ", members.bySlot() ? "slot " : "rank ", index, " is listed twice");
    seen[static_cast<size_t>(rank)] = true;
    values[static_cast<size_t>(rank)] = value;
  }
  return values;
}

std::vector<int64_t> parseRankCaps(const std::string& variable, const std::string& text,
                                   int worldSize) {
  // NaN marks an unlisted rank: a listed value is always finite.
  const auto values =
      parseRankValues(variable, text, worldSize, std::numeric_limits<double>::quiet_NaN());
  std::vector<int64_t> caps;
  for (size_t r = 0; r < values.size(); ++r) {
    const double v = values[r];
    if (std::isnan(v)) {
      caps.push_back(0);
      continue;
    }
    HDDP_CHECK_AS(ConfigError, v >= 1 && v <= 1e15 && v == std::floor(v), variable, "='", text,
                  "': rank ", r, "'s cap ", v,
                  " is not a whole number of samples >= 1 (a cap of 0 would give the rank "
                  "nothing to do; leave a rank out of the list for no cap)");
    caps.push_back(static_cast<int64_t>(v));
  }
  return caps;
}

void parseEmulatedMemory(const std::string& variable, const std::string& text, int worldSize,
                         int rank, EmulationOptions& options) {
  if (text.empty()) {
    return;
  }
  const ListMembers members = listMembersFromEnv(worldSize);
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto colon = item.find(':');
    const auto plus = item.find('+', colon == std::string::npos ? 0 : colon);
    const auto slash = item.find('/', plus == std::string::npos ? 0 : plus);
    HDDP_CHECK_AS(
        ConfigError,
        colon != std::string::npos && plus != std::string::npos && slash != std::string::npos,
        variable, "='", text, "': item '", item,
        "' is not rank:FIXED+PER_SAMPLE/TOTAL in MiB (e.g. 1:200+12/1000)");
    const int r = rankOfItem(variable, text, item, env::parseInt(variable, item.substr(0, colon)),
                             worldSize, members);
    const double fixed = env::parseFloat(variable, item.substr(colon + 1, plus - colon - 1));
    const double per = env::parseFloat(variable, item.substr(plus + 1, slash - plus - 1));
    const double total = env::parseFloat(variable, item.substr(slash + 1));
    HDDP_CHECK_AS(ConfigError,
                  std::isfinite(fixed) && std::isfinite(per) && std::isfinite(total) &&
                      fixed >= 0 && per > 0 && total > fixed,
                  variable, "='", text, "': item '", item,
                  "' needs FIXED >= 0, PER_SAMPLE > 0 and a TOTAL above FIXED (MiB)");
    if (r == rank) {
      constexpr double kMiB = 1024.0 * 1024.0;
      options.memoryFixedBytes = fixed * kMiB;
      options.memoryPerSampleBytes = per * kMiB;
      options.memoryTotalBytes = total * kMiB;
    }
  }
}

double slowestEmulatedLink(const std::vector<double>& gbpsPerRank) {
  double slowest = 0.0;
  for (const double gbps : gbpsPerRank) {
    if (gbps > 0 && (slowest == 0.0 || gbps < slowest)) {
      slowest = gbps;
    }
  }
  return slowest * 1e9;
}

EmulationOptions emulationFromEnv(int rank, int worldSize) {
  HDDP_CHECK(rank >= 0 && rank < worldSize, "emulationFromEnv: rank ", rank,
             " is outside a job of ", worldSize, " rank(s)");
  EmulationOptions o;
  o.slowdown = parseRankValues("HDDP_EMULATE_SLOWDOWN", env::getString("HDDP_EMULATE_SLOWDOWN"),
                               worldSize, 1.0)[static_cast<size_t>(rank)];
  const std::vector<double> links = parseRankValues(
      "HDDP_EMULATE_LINK_GBPS", env::getString("HDDP_EMULATE_LINK_GBPS"), worldSize, 0.0);
  o.linkBytesPerSecond = links[static_cast<size_t>(rank)] * 1e9;
  o.collectiveBytesPerSecond = slowestEmulatedLink(links);
  o.linkLatencySeconds = env::getFloat("HDDP_EMULATE_LINK_LATENCY_US") * 1e-6;
  o.memoryCapSamples =
      parseRankCaps("HDDP_EMULATE_MEMORY_CAP", env::getString("HDDP_EMULATE_MEMORY_CAP"),
                    worldSize)[static_cast<size_t>(rank)];
  parseEmulatedMemory("HDDP_EMULATE_MEMORY", env::getString("HDDP_EMULATE_MEMORY"), worldSize, rank,
                      o);
  o.validate(rank);
  return o;
}

void EmulationOptions::validate(int rank) const {
  HDDP_CHECK_AS(ConfigError, std::isfinite(slowdown) && slowdown >= 1.0 && slowdown <= 1e6,
                "emulated slowdown for rank ", rank, " is ", slowdown,
                "; a slowdown factor is a finite number from 1 to 1e6");
  HDDP_CHECK_AS(ConfigError, std::isfinite(linkBytesPerSecond) && linkBytesPerSecond >= 0,
                "emulated link bandwidth for rank ", rank, " is ", linkBytesPerSecond / 1e9,
                " GB/s; give a finite positive bandwidth (or leave the rank out)");
  HDDP_CHECK_AS(ConfigError,
                std::isfinite(collectiveBytesPerSecond) && collectiveBytesPerSecond >= 0,
                "emulated link under the collectives is ", collectiveBytesPerSecond / 1e9,
                " GB/s; give a finite positive bandwidth (or none)");
  HDDP_CHECK_AS(ConfigError, std::isfinite(linkLatencySeconds) && linkLatencySeconds >= 0,
                "emulated link latency is ", linkLatencySeconds * 1e6,
                " us; give a finite latency >= 0");
  HDDP_CHECK_AS(ConfigError, memoryCapSamples >= 0, "emulated memory cap for rank ", rank, " is ",
                memoryCapSamples, "; give a number of samples >= 1");
  HDDP_CHECK_AS(
      ConfigError,
      memoryTotalBytes == 0 || (std::isfinite(memoryTotalBytes) && memoryFixedBytes >= 0 &&
                                memoryPerSampleBytes > 0 && memoryTotalBytes > memoryFixedBytes),
      "emulated memory for rank ", rank, ": ", memoryFixedBytes, " B + ", memoryPerSampleBytes,
      " B/sample of ", memoryTotalBytes,
      " B; give a fixed part >= 0, a per-sample part > 0 and a total above the fixed part");
}

Emulator::Emulator(EmulationOptions options, int rank, Sleep sleep, Clocks clocks)
    : options_(options), sleep_(std::move(sleep)), clocks_(std::move(clocks)) {
  options_.validate(rank);
  if (!sleep_) {
    sleep_ = [](std::chrono::duration<double> d) { std::this_thread::sleep_for(d); };
  }
  if (!clocks_.now) {
    clocks_.now = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
    };
  }
  if (!clocks_.queued) {
    clocks_.queued = threadQueuedSeconds;
  }
  if (options_.active()) {
    HDDP_LOG_WARN(
        "balance", "EMULATION ON for rank ", rank, ": compute x", options_.slowdown,
        options_.linkBytesPerSecond > 0
            ? c10::str(", input link ", options_.linkBytesPerSecond / 1e9, " GB/s")
            : std::string(),
        options_.collectiveBytesPerSecond > 0 || options_.linkLatencySeconds > 0
            ? c10::str(", collectives over a ring of ",
                       options_.collectiveBytesPerSecond > 0
                           ? c10::str(options_.collectiveBytesPerSecond / 1e9, " GB/s")
                           : std::string("unlimited bandwidth"),
                       options_.linkLatencySeconds > 0
                           ? c10::str(" + ", options_.linkLatencySeconds * 1e6, " us per message")
                           : std::string())
            : std::string(),
        options_.memoryCapSamples > 0
            ? c10::str(", out of memory above ", options_.memoryCapSamples, " samples")
            : std::string(),
        options_.emulatesMemory()
            ? c10::str(", memory ", options_.memoryFixedBytes / (1 << 20), " MiB + ",
                       options_.memoryPerSampleBytes / (1 << 20), " MiB/sample of ",
                       options_.memoryTotalBytes / (1 << 20), " MiB")
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
  const double needed =
      options_.memoryFixedBytes + options_.memoryPerSampleBytes * static_cast<double>(samples);
  if (options_.emulatesMemory() && needed > options_.memoryTotalBytes) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "emulated out of memory: ", samples, " samples need ",
                     needed / (1 << 20), " MiB of the emulated ",
                     options_.memoryTotalBytes / (1 << 20), " MiB (HDDP_EMULATE_MEMORY)");
  }
}

double Emulator::apply(double computeSeconds, int64_t bytesMoved, double queuedSeconds) {
  return stretchStep(computeSeconds, bytesMoved, queuedSeconds, 0.0);
}

// The step's extra time on the emulated card and link; sleeps what `alreadySlept` (the
// marks, during the step) has not. Returns the emulated step's compute seconds.
double Emulator::stretchStep(double computeSeconds, int64_t bytesMoved, double queuedSeconds,
                             double alreadySlept) {
  if (!options_.active()) {
    return computeSeconds;
  }
  const double own = std::max(0.0, computeSeconds - std::max(0.0, queuedSeconds));
  double extra = (options_.slowdown - 1.0) * own;
  if (options_.linkBytesPerSecond > 0 && bytesMoved > 0) {
    extra += static_cast<double>(bytesMoved) / options_.linkBytesPerSecond;
  }
  if (extra > alreadySlept) {
    sleep_(std::chrono::duration<double>(extra - alreadySlept));
  }
  // The marks measured compute the timer also saw, at most (slowdown - 1) x it, so they
  // never sleep more than `extra`, but for a queue read on another thread.
  return computeSeconds + std::max(extra, alreadySlept);
}

void Emulator::beginStep(int64_t step, int64_t samples) {
  open_ = options_.slowdown > 1.0 && samples > 0;
  slept_.erase(step);  // a repeated step starts afresh
  if (!open_) {
    return;
  }
  openStep_ = step;
  slept_[step] = 0.0;
  mark();
}

void Emulator::endForward() {
  if (open_) {
    stretchSinceMark();
  }
}

void Emulator::beforeBucketLaunch(int /*bucket*/) {
  if (open_) {
    stretchSinceMark();
  }
}

double Emulator::sleptInStep(int64_t step) const {
  const auto it = slept_.find(step);
  return it == slept_.end() ? 0.0 : it->second;
}

void Emulator::mark() {
  lastMark_ = clocks_.now();
  lastQueued_ = clocks_.queued();
  lastThread_ = std::this_thread::get_id();
}

// The compute since the previous mark, as the slower card takes it longer: its time
// queued for a core left out where the same thread read both marks (a device's
// backward runs on the autograd engine's own thread, whose queue says nothing of the
// training thread's).
double Emulator::stretchSinceMark() {
  const double now = clocks_.now();
  double own = now - lastMark_;
  if (std::this_thread::get_id() == lastThread_ && lastQueued_ >= 0) {
    const double queued = clocks_.queued();
    if (queued >= lastQueued_) {
      own -= queued - lastQueued_;
    }
  }
  const double extra = (options_.slowdown - 1.0) * std::max(0.0, own);
  if (extra > 0) {
    sleep_(std::chrono::duration<double>(extra));
    slept_[openStep_] += extra;
  }
  mark();  // the next part starts where this one's stretched end is
  return extra;
}

Emulator::Measured Emulator::measure(const StepTiming& timing) {
  Measured out;
  StepMeasurement& m = out.measurement;
  m.samples = timing.label.samples;
  m.bytes = timing.label.bytes;
  // The marks' sleeps lie inside the timer's span and count there as compute: take them
  // out, then stretch the real compute and sleep what the marks have not.
  double slept = 0.0;
  for (auto it = slept_.begin(); it != slept_.end() && it->first <= timing.label.step;) {
    if (it->first == timing.label.step) {
      slept = it->second;
    }
    it = slept_.erase(it);  // older ones were never measured (dropped steps)
  }
  if (open_ && openStep_ <= timing.label.step) {
    open_ = false;
  }
  m.computeSeconds = std::max(0.0, timing.computeSeconds() - slept);
  m.fixedSeconds = timing.tailSeconds;
  // The input copy as the copy stream's events timed it (a device rank; 0 on CPU).
  m.transferSeconds = timing.transferSeconds;
  double emulatedTransfer = 0.0;
  if (active() && m.samples > 0) {
    const double before = m.computeSeconds;
    const double total =
        stretchStep(m.computeSeconds, m.bytes, std::min(timing.queuedSeconds, before), slept);
    out.emulatedSeconds = total - before;
    emulatedTransfer = transferSeconds(m.bytes);
    m.computeSeconds = total - emulatedTransfer;
    m.fixedSeconds = stretch(m.fixedSeconds);
    if (emulatedTransfer > 0) {
      m.transferSeconds = emulatedTransfer;  // the emulated link replaces the real one
    }
  }
  out.computeSeconds = m.computeSeconds + emulatedTransfer;
  return out;
}

}  // namespace hddp
