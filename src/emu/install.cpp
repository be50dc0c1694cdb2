// install(), the options and the environment, and the per-device counters.

#include <ATen/Context.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

#include "emu/allocator.h"
#include "emu/guard.h"
#include "emu/ordering.h"
#include "emu/runtime.h"
#include "emu/streams.h"
#include "hddp/emu/emu.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

std::atomic<int> gDeviceCount{0};

struct DeviceState {
  double slowdown = 1.0;
  DeviceCounters counters;
};

std::mutex& deviceMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

std::array<DeviceState, kMaxDevices>& devices() {
  static auto* states = new std::array<DeviceState, kMaxDevices>;
  return *states;
}

thread_local int tlsTimedDepth = 0;
thread_local int tlsHostDepth = 0;

struct DepthScope {
  explicit DepthScope(int& depth) : depth_(depth) { ++depth_; }
  ~DepthScope() { --depth_; }
  DepthScope(const DepthScope&) = delete;
  DepthScope& operator=(const DepthScope&) = delete;
  int& depth_;
};

const char* envValue(const char* name) {
  const char* value = std::getenv(name);
  return (value != nullptr && *value != '\0') ? value : nullptr;
}

int64_t parseInteger(const char* name, const std::string& whole, const std::string& text,
                     int64_t low, int64_t high, const char* expected) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != text.c_str() && *end == '\0' && v >= low && v <= high, name,
              "='", whole, "' is not valid: expected ", expected);
  return v;
}

double parseNumber(const char* name, const std::string& whole, const std::string& text,
                   const char* expected) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  TORCH_CHECK(errno == 0 && end != text.c_str() && *end == '\0' && std::isfinite(v), name, "='",
              whole, "' is not valid: expected ", expected);
  return v;
}

void validate(const EmuOptions& o) {
  TORCH_CHECK(o.deviceCount >= 1 && o.deviceCount <= kMaxDevices,
              "hddp::emu: EmuOptions::deviceCount=", o.deviceCount, " must be from 1 to ",
              kMaxDevices);
  for (const auto& [device, factor] : o.slowdown) {
    TORCH_CHECK(device >= 0 && device < o.deviceCount,
                "hddp::emu: EmuOptions::slowdown names emu:", device, ", but there are only ",
                o.deviceCount, " devices");
    TORCH_CHECK(std::isfinite(factor) && factor >= 1.0, "hddp::emu: the slowdown of emu:", device,
                " is ", factor, ": expected a factor >= 1 (1 = full speed)");
  }
  TORCH_CHECK(o.memoryBytes > 0, "hddp::emu: EmuOptions::memoryBytes=", o.memoryBytes,
              " must be > 0");
  TORCH_CHECK(o.streamDelay.count() >= 0,
              "hddp::emu: EmuOptions::streamDelay=", o.streamDelay.count(), " ms must be >= 0");
}

}  // namespace

int installedDeviceCount() noexcept { return gDeviceCount.load(); }

void checkDeviceIndex(c10::DeviceIndex index) {
  const int count = installedDeviceCount();
  TORCH_CHECK(count > 0, "hddp::emu is not installed: call hddp::emu::install() first");
  TORCH_CHECK(index >= 0 && index < count, "hddp::emu: emu:", static_cast<int>(index),
              " does not exist: there are ", count,
              " emulated devices (HDDP_EMU_DEVICES, EmuOptions::deviceCount)");
}

std::atomic<int64_t>& streamDelayMs() {
  static std::atomic<int64_t> delay{0};
  return delay;
}

void runTimed(c10::Device device, const std::function<void()>& work) {
  if (tlsTimedDepth > 0 || !device.is_privateuseone() || !device.has_index()) {
    work();
    return;
  }
  DepthScope scope(tlsTimedDepth);
  const auto start = std::chrono::steady_clock::now();
  work();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double extra = 0;
  {
    std::lock_guard<std::mutex> lock(deviceMutex());
    auto& d = devices().at(device.index());
    extra = (d.slowdown - 1.0) * seconds;
    ++d.counters.ops;
    d.counters.computeSeconds += seconds;
    d.counters.slowdownSeconds += extra;
  }
  if (extra > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(extra));
  }
}

void runOnHost(c10::Device device, const std::function<void()>& work) {
  if (tlsHostDepth == 0 && device.is_privateuseone() && device.has_index()) {
    const c10::Stream stream = currentStreamOf(device.index());
    if (stream.id() != 0) {
      worker(stream).drain();
    }
  }
  DepthScope scope(tlsHostDepth);
  runTimed(device, work);
}

bool insideHostOperator() noexcept { return tlsHostDepth > 0; }

}  // namespace detail

EmuOptions optionsFromEnv() {
  using detail::parseInteger;
  EmuOptions o;
  if (const char* v = detail::envValue("HDDP_EMU_DEVICES")) {
    o.deviceCount =
        static_cast<int>(parseInteger("HDDP_EMU_DEVICES", v, v, 1, detail::kMaxDevices,
                                      "an integer from 1 to 64 (the number of emu devices)"));
  }
  if (const char* v = detail::envValue("HDDP_EMU_SLOWDOWN")) {
    const char* expected =
        "comma-separated device:factor pairs with a factor >= 1 for an existing device, "
        "e.g. '1:3' (emu:1 runs 3x slower)";
    std::stringstream items(v);
    std::string item;
    while (std::getline(items, item, ',')) {
      const auto colon = item.find(':');
      TORCH_CHECK(colon != std::string::npos, "HDDP_EMU_SLOWDOWN='", v, "' is not valid: expected ",
                  expected);
      const int64_t device = parseInteger("HDDP_EMU_SLOWDOWN", v, item.substr(0, colon), 0,
                                          o.deviceCount - 1, expected);
      const double factor =
          detail::parseNumber("HDDP_EMU_SLOWDOWN", v, item.substr(colon + 1), expected);
      TORCH_CHECK(factor >= 1.0, "HDDP_EMU_SLOWDOWN='", v, "' is not valid: expected ", expected);
      o.slowdown[static_cast<int>(device)] = factor;
    }
  }
  if (const char* v = detail::envValue("HDDP_EMU_MEMORY_GIB")) {
    const double gib = detail::parseNumber("HDDP_EMU_MEMORY_GIB", v, v,
                                           "a number of GiB > 0 (the memory of each emu device)");
    TORCH_CHECK(gib > 0 && gib < 1e9, "HDDP_EMU_MEMORY_GIB='", v,
                "' is not valid: expected a number of GiB > 0 (the memory of each emu device)");
    o.memoryBytes = static_cast<int64_t>(gib * static_cast<double>(int64_t{1} << 30));
  }
  if (const char* v = detail::envValue("HDDP_EMU_STREAM_DELAY_MS")) {
    o.streamDelay = std::chrono::milliseconds(parseInteger(
        "HDDP_EMU_STREAM_DELAY_MS", v, v, 0, 3600 * 1000,
        "an integer number of milliseconds >= 0 (the delay before each queued stream task)"));
  }
  return o;
}

void install(const EmuOptions& options) {
  detail::validate(options);
  static std::mutex installMutex;
  std::lock_guard<std::mutex> lock(installMutex);
  const int installed = detail::installedDeviceCount();
  if (installed == 0) {
    c10::register_privateuse1_backend("emu");
    detail::configureMemory(options.deviceCount, options.memoryBytes);
    c10::SetAllocator(c10::DeviceType::PrivateUse1, detail::deviceAllocator());
    detail::gDeviceCount.store(options.deviceCount);
    detail::registerGuard();
    detail::registerHooks();
    // Never destroyed: the registrations must outlive every tensor, up to the process's
    // exit. Held by a static pointer (no destructor runs) rather than dropped, so that
    // LeakSanitizer sees them reachable, not leaked (scripts/sanitize.sh).
    static torch::Library* registrations[4] = {};
    auto* aten = registrations[0] = new torch::Library(
        torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    detail::registerKernels(*aten);
    auto* all = registrations[1] = new torch::Library(
        torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    detail::registerFallback(*all);
    auto* autocastAten = registrations[2] = new torch::Library(
        torch::Library::IMPL, "aten", c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
    auto* autocastAll = registrations[3] = new torch::Library(
        torch::Library::IMPL, "_", c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
    detail::registerAutocast(*autocastAten, *autocastAll);
    at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
  } else {
    TORCH_CHECK(options.deviceCount == installed, "hddp::emu is already installed with ", installed,
                " devices; it cannot change to ", options.deviceCount, " in the same process");
    detail::configureMemory(installed, options.memoryBytes);
  }
  {
    std::lock_guard<std::mutex> deviceLock(detail::deviceMutex());
    for (int i = 0; i < detail::kMaxDevices; ++i) {
      const auto it = options.slowdown.find(i);
      detail::devices()[i].slowdown = it == options.slowdown.end() ? 1.0 : it->second;
    }
  }
  detail::streamDelayMs().store(options.streamDelay.count());
}

void install() { install(optionsFromEnv()); }

bool isInstalled() { return detail::installedDeviceCount() > 0; }

int deviceCount() { return detail::installedDeviceCount(); }

void setMemoryTotal(int device, int64_t bytes) { detail::setDeviceMemoryTotal(device, bytes); }

int64_t memoryTotal(int device) { return detail::deviceMemoryTotal(device); }

void setSlowdown(int device, double factor) {
  detail::checkDeviceIndex(static_cast<c10::DeviceIndex>(device));
  TORCH_CHECK(std::isfinite(factor) && factor >= 1.0,
              "hddp::emu::setSlowdown: the factor of emu:", device, " is ", factor,
              ": expected >= 1 (1 = full speed)");
  std::lock_guard<std::mutex> lock(detail::deviceMutex());
  detail::devices()[device].slowdown = factor;
}

void setStreamDelay(std::chrono::milliseconds delay) {
  TORCH_CHECK(delay.count() >= 0, "hddp::emu::setStreamDelay: the delay must be >= 0 ms, got ",
              delay.count());
  detail::streamDelayMs().store(delay.count());
}

DeviceCounters counters(int device) {
  detail::checkDeviceIndex(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(detail::deviceMutex());
  return detail::devices()[device].counters;
}

void resetCounters() {
  std::lock_guard<std::mutex> lock(detail::deviceMutex());
  for (auto& d : detail::devices()) {
    d.counters = DeviceCounters{};
  }
}

std::vector<std::string> violations() { return detail::storedViolations(); }

void clearViolations() {
  detail::clearStoredViolations();
  detail::resetStrayReports();  // a later stray allocation is reported again
}

void checkNoViolations() {
  const auto found = detail::storedViolations();
  if (found.empty()) {
    return;
  }
  std::ostringstream out;
  out << "hddp::emu: " << found.size() << " stream-safety violation(s):";
  for (const auto& v : found) {
    out << "\n  " << v;
  }
  TORCH_CHECK(false, out.str());
}

}  // namespace emu
}  // namespace hddp
