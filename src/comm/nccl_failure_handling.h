// How LibTorch's ProcessGroupNCCL (torch 2.11) ends a collective that cannot complete,
// for example one waiting for a peer that died: the TORCH_NCCL_* settings that decide
// it, what ends the collective and how long it takes at most. Plain C++, no CUDA: the
// CPU tests check these rules; nccl_backend.cpp applies them to the process's own
// environment when it creates a communicator.
//
// What the rules model (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, 2.11):
// - An NCCL Work's wait() without a timeout only makes the current stream wait for the
//   collective; the host goes on. Unless TORCH_NCCL_BLOCKING_WAIT is on, a watchdog
//   thread polls every Work every 100 ms for NCCL's asynchronous error and for the
//   process group's timeout (hddp's communicator timeout). On either it sleeps
//   4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (time for the flight recorder's dump), then
//   aborts the communicators if the mode says so (1, 2) and rethrows the error on its
//   own thread if the mode says so (1, 3): std::terminate, the process ends on SIGABRT.
// - With TORCH_NCCL_BLOCKING_WAIT on there is no watchdog: wait() polls the Work and,
//   past the timeout (or on NCCL's error), aborts the communicator and throws on the
//   caller's thread, which hddp raises as hddp::TimeoutError / BackendError.
// - TORCH_NCCL_DESYNC_DEBUG turns mode 0 into 3 (without blocking wait).
#pragma once

#include <algorithm>
#include <cctype>
#include <chrono>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hddp/core/error.h"

namespace hddp {
namespace detail {

/// The ProcessGroupNCCL settings that decide how a failed or stuck collective ends, as
/// torch 2.11 reads them when a process group is created. Defaults: torch's.
struct NcclFailureSettings {
  /// TORCH_NCCL_ASYNC_ERROR_HANDLING (or the older NCCL_ASYNC_ERROR_HANDLING): 0 no
  /// handling, 1 abort the communicators then end the process, 2 abort only, 3 end the
  /// process without aborting. Default 3.
  int asyncErrorHandling = 3;
  /// The variable that set it (for messages): the TORCH_ name unless only the older is set.
  std::string asyncErrorHandlingName = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
  /// TORCH_NCCL_BLOCKING_WAIT (or NCCL_BLOCKING_WAIT). Default off.
  bool blockingWait = false;
  /// TORCH_NCCL_DESYNC_DEBUG (or NCCL_DESYNC_DEBUG). Default off.
  bool desyncDebug = false;
  /// TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC; the watchdog waits 4x this. Default 15 s.
  std::chrono::milliseconds dumpTimeout{15000};
};

/// What ends a collective that cannot complete.
enum class NcclFailureEnd {
  /// c10d's watchdog ends the process (SIGABRT); no error reaches the caller.
  ProcessEnds,
  /// Work::wait() raises (hddp::TimeoutError or BackendError) on the caller's thread.
  WaitRaises,
  /// Nothing: the process can hang for ever (or go on with an aborted communicator).
  Nothing,
};

struct NcclFailureHandling {
  NcclFailureEnd end = NcclFailureEnd::Nothing;
  /// From the collective's launch to its end at the latest; zero for Nothing.
  std::chrono::milliseconds bound{0};
  /// For the log: what happens, and which variables made it so.
  std::string description;
};

/// A variable's value, or nullopt when it is not set (the environment, or a test's map).
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;

namespace nccl_failure {

constexpr std::chrono::milliseconds kWatchdogPeriod{100};  // kWatchdogThreadSleepMillis

// c10d's getCvar*: the first name that is set wins (TORCH_NCCL_* before the older one).
inline std::optional<std::pair<std::string, std::string>> firstSet(
    const EnvironmentLookup& lookup, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    if (auto value = lookup(name)) {
      return std::make_pair(name, *value);
    }
  }
  return std::nullopt;
}

inline std::optional<int> readInt(const EnvironmentLookup& lookup,
                                  const std::vector<std::string>& names) {
  const auto found = firstSet(lookup, names);
  if (!found) {
    return std::nullopt;
  }
  try {
    return std::stoi(found->second);  // as c10d's getCvarInt
  } catch (const std::exception&) {
    HDDP_THROW(ConfigError, found->first, "='", found->second,
               "' is not an integer; ProcessGroupNCCL would refuse it too. Unset it or give "
               "a number.");
  }
}

inline std::optional<bool> readBool(const EnvironmentLookup& lookup,
                                    const std::vector<std::string>& names) {
  const auto found = firstSet(lookup, names);
  if (!found) {
    return std::nullopt;
  }
  std::string v = found->second;
  std::transform(v.begin(), v.end(), v.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (v == "y" || v == "yes" || v == "1" || v == "t" || v == "true") {  // as getCvarBool
    return true;
  }
  if (v == "n" || v == "no" || v == "0" || v == "f" || v == "false") {
    return false;
  }
  HDDP_THROW(ConfigError, found->first, "='", found->second,
             "' is not a boolean; ProcessGroupNCCL would refuse it too. Use 1 or 0.");
}

}  // namespace nccl_failure

/// Reads the settings through `lookup`. A value torch would refuse: hddp::ConfigError.
inline NcclFailureSettings readNcclFailureSettings(const EnvironmentLookup& lookup) {
  using namespace nccl_failure;
  NcclFailureSettings s;
  const std::vector<std::string> modeNames = {"TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                              "NCCL_ASYNC_ERROR_HANDLING"};
  if (auto v = readInt(lookup, modeNames)) {
    s.asyncErrorHandling = *v;
    s.asyncErrorHandlingName = firstSet(lookup, modeNames)->first;
  }
  if (auto v = readBool(lookup, {"TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"})) {
    s.blockingWait = *v;
  }
  if (auto v = readBool(lookup, {"TORCH_NCCL_DESYNC_DEBUG", "NCCL_DESYNC_DEBUG"})) {
    s.desyncDebug = *v;
  }
  if (auto v = readInt(lookup, {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"})) {
    s.dumpTimeout = std::chrono::milliseconds(std::max(0, *v));
  }
  return s;
}

/// How a collective launched on a communicator with `timeout` ends when it cannot
/// complete (a peer lost, a peer that stopped calling collectives, NCCL's error).
inline NcclFailureHandling ncclFailureHandling(const NcclFailureSettings& s,
                                               std::chrono::milliseconds timeout) {
  using std::chrono::milliseconds;
  const auto ms = [](milliseconds d) { return std::to_string(d.count()) + " ms"; };
  NcclFailureHandling h;
  if (s.blockingWait) {
    h.end = NcclFailureEnd::WaitRaises;
    h.bound = timeout;
    h.description =
        "TORCH_NCCL_BLOCKING_WAIT is on: no watchdog; wait() blocks the host and "
        "raises on NCCL's error or after the timeout (" +
        ms(timeout) +
        "), aborting the communicator. A Work that is only synchronize()d is "
        "not watched.";
    return h;
  }
  int mode = s.asyncErrorHandling;
  const bool promoted = mode == 0 && s.desyncDebug;
  if (promoted) {
    mode = 3;
  }
  const bool cleanUp = mode != 0 && mode != 3;   // c10d's SHOULD_CLEAN_UP
  const bool tearDown = mode != 0 && mode != 2;  // c10d's SHOULD_TEAR_DOWN
  const std::string setting = s.asyncErrorHandlingName + "=" +
                              std::to_string(s.asyncErrorHandling) +
                              (promoted ? " (3 under TORCH_NCCL_DESYNC_DEBUG)" : "");
  if (!tearDown) {
    h.end = NcclFailureEnd::Nothing;
    h.description =
        setting +
        (cleanUp ? ": the watchdog aborts the communicator but raises nothing, so the "
                   "process goes on with partial results"
                 : ": the watchdog only logs, so a host waiting for the result hangs "
                   "for ever") +
        ". A rank whose peer is lost never exits and torchrun cannot restart the job. Unset "
        "it (torch's default 3 ends the process) or set TORCH_NCCL_BLOCKING_WAIT=1.";
    return h;
  }
  h.end = NcclFailureEnd::ProcessEnds;
  h.bound = timeout + 4 * s.dumpTimeout + nccl_failure::kWatchdogPeriod;
  h.description = setting + ": c10d's watchdog " +
                  (cleanUp ? "aborts the communicators and " : "") +
                  "ends the process (SIGABRT) within the timeout (" + ms(timeout) +
                  ") + 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (" + ms(s.dumpTimeout) +
                  ") of a collective's launch, sooner when NCCL reports the error itself.";
  return h;
}

}  // namespace detail
}  // namespace hddp
