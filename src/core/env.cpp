#include "hddp/core/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "hddp/core/error.h"

namespace hddp {
namespace env {
namespace {

// The registry. Add a variable here and nowhere else.
std::vector<Variable> makeRegistry() {
  return {
      {"HDDP_LOG_LEVEL",
       Type::String,
       "info",
       "Log threshold: trace, debug, info, warn, error or off.",
       {"HDDP_LOGLEVEL"}},
      {"HDDP_BACKEND",
       Type::String,
       "auto",
       "Collective backend: auto (agreed at rendezvous: NCCL when every rank is on its own "
       "CUDA device, Gloo otherwise), gloo or nccl; the same on every rank.",
       {}},
      {"HDDP_TIMEOUT_SEC",
       Type::Int,
       "0",
       "Timeout of rendezvous and collectives in seconds; 0 = PyTorch's defaults "
       "(30 min Gloo, 10 min NCCL).",
       {}},
      {"HDDP_GLOO_INTERFACE",
       Type::String,
       "",
       "Network interface Gloo binds to (e.g. eth0); empty = resolve the hostname, "
       "falling back to loopback.",
       {"GLOO_SOCKET_IFNAME"}},
      {"HDDP_GLOO_THREADS", Type::Int, "2", "Gloo worker threads per communicator.", {}},
      {"HDDP_FAULT",
       Type::String,
       "",
       "Faults on purpose (tests, chaos runs): e.g. "
       "kill@step=5,rank=1;nospace@save=2;raise@collective=40 "
       "(hddp/core/fault.h, docs/reliability.md); off when empty, logged when on.",
       {}},
      {"HDDP_FAULT_ONCE_DIR",
       Type::String,
       "",
       "With HDDP_FAULT: a folder where each fault marks that it acted, so that it acts once "
       "per job, in whichever process meets it first (restart=* then suits elastic jobs).",
       {}},
      {"HDDP_EMULATE_SLOWDOWN",
       Type::String,
       "",
       "Emulation (tests/demos): compute slowdown per rank, e.g. 1:3 (rank 1 three times slower).",
       {}},
      {"HDDP_EMULATE_LINK_GBPS",
       Type::String,
       "",
       "Emulation (tests/demos): link bandwidth per rank in GB/s, e.g. 1:2.8: the rank's "
       "input copies, and every collective at the slowest listed link's ring time.",
       {}},
      {"HDDP_EMULATE_LINK_LATENCY_US",
       Type::Float,
       "0",
       "Emulation (tests/demos): latency per message of the emulated link under the "
       "collectives, in microseconds.",
       {}},
      {"HDDP_EMULATE_MEMORY_CAP",
       Type::String,
       "",
       "Emulation (tests/demos): out of memory above this many samples per step, e.g. 1:40.",
       {}},
      {"HDDP_DEVICE_TABLE",
       Type::String,
       "",
       "What-if planning: the device table to use instead of hddp's (data/devices.json, "
       "installed as share/hddp/devices.json).",
       {}},
      {"HDDP_EMULATE_MEMORY",
       Type::String,
       "",
       "Emulation (tests/demos): a rank's device memory in MiB as rank:FIXED+PER_SAMPLE/TOTAL, "
       "e.g. 1:200+12/1000; what the Trainer measures and derives memory caps from, and out "
       "of memory when a step needs more than TOTAL.",
       {}},
      {"HDDP_DEVICE",
       Type::String,
       "",
       "Device of the ranks: one for all (cpu, cuda, cuda:N) or one per local rank "
       "(cuda:0,cpu); empty = cuda:<local rank> with CUDA, else cpu. hddp-run --devices sets it.",
       {}},
      {"HDDP_LOG_SAMPLES",
       Type::String,
       "",
       "Debugging: each rank appends '<generation> <step> <rank> <sample indices...>' per "
       "step to <value>.rank<r> (elastic jobs: which samples each step trained); empty = off.",
       {}},
      {"HDDP_BF16_FALLBACK",
       Type::Bool,
       "true",
       "bf16 asked for on a device without native bf16 (a CPU without avx512_bf16/amx_bf16): "
       "train in float32 instead, as emulated bf16 is slower. 0 keeps bf16.",
       {}},
      {"HDDP_ALLOW_SHARED_DEVICE",
       Type::Bool,
       "false",
       "Let several local ranks use one CUDA device (Gloo staging only; for testing on a "
       "single GPU).",
       {}},
  };
}

std::string toLower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) {
    return "";
  }
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

template <typename T, typename Parse>
Resolved<T> resolveWith(const std::string& name, std::optional<T> explicitValue, Parse parse) {
  const Variable& var = variable(name);
  if (explicitValue) {
    return {*explicitValue, Source::Explicit, "option"};
  }
  std::string setBy;
  if (auto text = lookup(name, &setBy)) {
    return {parse(setBy, *text), Source::Environment, setBy};
  }
  return {parse(name + " (default)", var.defaultValue), Source::Default, "default"};
}

}  // namespace

const std::vector<Variable>& registry() {
  static const std::vector<Variable> vars = makeRegistry();
  return vars;
}

const Variable& variable(const std::string& name) {
  for (const auto& var : registry()) {
    if (var.name == name) {
      return var;
    }
  }
  HDDP_THROW(Error, "'", name,
             "' is not a registered hddp environment variable; add it to "
             "the registry in src/core/env.cpp");
}

const char* sourceName(Source source) noexcept {
  switch (source) {
    case Source::Explicit:
      return "option";
    case Source::Environment:
      return "environment";
    case Source::Default:
      return "default";
  }
  return "?";
}

std::optional<std::string> lookup(const std::string& name, std::string* setBy) {
  const Variable& var = variable(name);
  std::vector<std::string> names{var.name};
  names.insert(names.end(), var.aliases.begin(), var.aliases.end());
  for (const auto& candidate : names) {
    if (const char* value = std::getenv(candidate.c_str())) {
      if (setBy) {
        *setBy = candidate;
      }
      return std::string(value);
    }
  }
  return std::nullopt;
}

bool parseBool(const std::string& name, const std::string& text) {
  const std::string v = toLower(trim(text));
  if (v == "1" || v == "true" || v == "yes" || v == "on") {
    return true;
  }
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) {
    return false;
  }
  HDDP_THROW(ConfigError, name, "='", text,
             "' is not a boolean; use 1/0, true/false, yes/no or on/off");
}

int64_t parseInt(const std::string& name, const std::string& text) {
  const std::string v = trim(text);
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(v.c_str(), &end, 10);
  HDDP_CHECK_AS(ConfigError, !v.empty() && end && *end == '\0', name, "='", text,
                "' is not an integer; set it to a whole number such as 4");
  HDDP_CHECK_AS(ConfigError, errno != ERANGE, name, "='", text,
                "' is out of range for a 64-bit integer");
  return static_cast<int64_t>(parsed);
}

double parseFloat(const std::string& name, const std::string& text) {
  const std::string v = trim(text);
  errno = 0;
  char* end = nullptr;
  const double parsed = std::strtod(v.c_str(), &end);
  HDDP_CHECK_AS(ConfigError, !v.empty() && end && *end == '\0' && errno == 0, name, "='", text,
                "' is not a number; set it to a value such as 2.5");
  HDDP_CHECK_AS(ConfigError, std::isfinite(parsed), name, "='", text,
                "' is not a finite number; set it to a value such as 2.5");
  return parsed;
}

std::chrono::seconds timeoutFromEnv() {
  const int64_t seconds = getInt("HDDP_TIMEOUT_SEC");
  HDDP_CHECK_AS(ConfigError, seconds >= 0 && seconds <= kMaxTimeoutSeconds,
                "HDDP_TIMEOUT_SEC=", seconds, " is out of range: give seconds from 1 to ",
                kMaxTimeoutSeconds, " (a year), or 0 for PyTorch's defaults");
  return std::chrono::seconds(seconds);
}

Resolved<bool> resolveBool(const std::string& name, std::optional<bool> explicitValue) {
  return resolveWith<bool>(name, explicitValue, parseBool);
}
Resolved<int64_t> resolveInt(const std::string& name, std::optional<int64_t> explicitValue) {
  return resolveWith<int64_t>(name, explicitValue, parseInt);
}
Resolved<double> resolveFloat(const std::string& name, std::optional<double> explicitValue) {
  return resolveWith<double>(name, explicitValue, parseFloat);
}
Resolved<std::string> resolveString(const std::string& name,
                                    std::optional<std::string> explicitValue) {
  return resolveWith<std::string>(name, std::move(explicitValue),
                                  [](const std::string&, const std::string& t) { return t; });
}

std::vector<Setting> describe() {
  std::vector<Setting> out;
  for (const auto& var : registry()) {
    std::string setBy = "default";
    Source source = Source::Default;
    std::string value = var.defaultValue;
    if (auto text = lookup(var.name, &setBy)) {
      value = *text;
      source = Source::Environment;
    } else {
      setBy = "default";
    }
    out.push_back({var.name, value, source, setBy, var.description});
  }
  return out;
}

std::string dump() {
  const auto settings = describe();
  size_t nameWidth = 0;
  size_t valueWidth = 0;
  for (const auto& s : settings) {
    nameWidth = std::max(nameWidth, s.name.size());
    valueWidth = std::max(valueWidth, s.value.size() + 2);
  }
  std::ostringstream os;
  for (const auto& s : settings) {
    std::string value = "'" + s.value + "'";
    os << s.name << std::string(nameWidth - s.name.size() + 2, ' ') << value
       << std::string(valueWidth - value.size() + 2, ' ')
       << (s.source == Source::Environment ? "from " + s.setBy : std::string("default")) << "  # "
       << s.description << "\n";
  }
  return os.str();
}

}  // namespace env
}  // namespace hddp
