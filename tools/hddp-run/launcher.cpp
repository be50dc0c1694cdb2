#include "launcher.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "group.h"

namespace hddp {
namespace run {

namespace detail {
int gSignalPipe[2] = {-1, -1};
}  // namespace detail

using detail::freePort;
using detail::Group;
using detail::gSignalPipe;
using detail::say;

namespace {

void onSignal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  const int saved = errno;
  (void)!write(gSignalPipe[1], &byte, 1);
  errno = saved;
}

}  // namespace

std::string siblingTool(const std::string& name) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    return "";
  }
  for (const auto& candidate :
       {self.parent_path() / name, self.parent_path().parent_path() / name / name}) {
    if (::access(candidate.c_str(), X_OK) == 0) {
      return candidate.string();
    }
  }
  return "";
}

std::string parseNproc(const std::string& text, LaunchConfig& config) {
  auto number = [](const std::string& t, int* out) {
    if (t.empty() || t.size() > 5 || t.find_first_not_of("0123456789") != std::string::npos) {
      return false;
    }
    *out = std::stoi(t);
    return *out >= 1 && *out <= 4096;
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    config.minProcs = 0;
    if (number(text, &config.nprocPerNode)) {
      return "";
    }
  } else if (number(text.substr(0, colon), &config.minProcs) &&
             number(text.substr(colon + 1), &config.nprocPerNode)) {
    if (config.minProcs <= config.nprocPerNode) {
      return "";
    }
    return "--nproc-per-node " + text + ": MIN is above MAX; give MIN:MAX with MIN <= MAX";
  }
  return "--nproc-per-node '" + text +
         "' is not a rank count: give N (1 to 4096) or MIN:MAX for an elastic job (e.g. 2:3)";
}

std::string parseUnplug(const std::string& text, LaunchConfig& config) {
  LaunchConfig::Unplug u;
  const size_t at = text.find('@');
  const size_t colon = text.find(':', at == std::string::npos ? 0 : at);
  auto seconds = [](const std::string& t, double* out) {
    char* end = nullptr;
    *out = std::strtod(t.c_str(), &end);
    return !t.empty() && end && *end == '\0' && *out >= 0;
  };
  bool ok = at != std::string::npos && at > 0 &&
            text.substr(0, at).find_first_not_of("0123456789") == std::string::npos;
  if (ok) {
    u.slot = std::stoi(text.substr(0, at));
    ok =
        seconds(
            text.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1),
            &u.at) &&
        (colon == std::string::npos || (seconds(text.substr(colon + 1), &u.back) && u.back > u.at));
  }
  if (!ok) {
    return "--emulate-unplug '" + text +
           "' is not SLOT@SECONDS[:BACK] (e.g. 2@30:60: slot 2 is killed 30 s after the start "
           "and can come back at 60 s)";
  }
  if (u.slot >= config.nprocPerNode) {
    return "--emulate-unplug '" + text + "': there is no slot " + std::to_string(u.slot) +
           " (slots 0.." + std::to_string(config.nprocPerNode - 1) + ")";
  }
  config.unplugs.push_back(u);
  return "";
}

std::string checkDevices(LaunchConfig& config, bool nprocGiven) {
  if (config.devices.empty()) {
    return config.shareDevices ? "--share-devices needs --devices (e.g. --devices cuda:0,cuda:0)"
                               : "";
  }
  const int n = static_cast<int>(config.devices.size());
  if (nprocGiven && n != config.nprocPerNode) {
    return "--devices lists " + std::to_string(n) + " device(s) but --nproc-per-node is " +
           std::to_string(config.nprocPerNode) +
           ": give one device per local rank (or leave --nproc-per-node out)";
  }
  config.nprocPerNode = n;
  std::vector<std::string> cuda;  // the CUDA device of each entry, "" for the CPU
  int nextCuda = 0;
  for (int i = 0; i < n; ++i) {
    std::string d = config.devices[static_cast<size_t>(i)];
    for (auto& c : d) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    const bool indexed = d.size() > 5 && d.size() <= 8 && d.rfind("cuda:", 0) == 0 &&
                         d.find_first_not_of("0123456789", 5) == std::string::npos;
    // hddp::emu's emulated devices: each rank's process has its own, so ranks may name
    // the same one; the rank checks that it installed emu and has that device.
    const bool emulated = d == "emu" || (d.size() > 4 && d.size() <= 7 && d.rfind("emu:", 0) == 0 &&
                                         d.find_first_not_of("0123456789", 4) == std::string::npos);
    if (emulated) {
      cuda.push_back("");
      config.devices[static_cast<size_t>(i)] = d;
      continue;
    }
    if (d != "cpu" && d != "cuda" && !indexed) {
      return "--devices entry " + std::to_string(i) + " '" +
             config.devices[static_cast<size_t>(i)] +
             "' is not a device; use cpu, cuda, cuda:N or emu:N (hddp::emu's emulated "
             "accelerator), one per local rank (e.g. --devices cuda:0,cpu)";
    }
    if (d == "cuda") {
      d = "cuda:" + std::to_string(nextCuda);
    }
    if (d != "cpu") {
      nextCuda = std::stoi(d.substr(5)) + 1;
      for (int j = 0; j < i && !config.shareDevices; ++j) {
        if (cuda[static_cast<size_t>(j)] == d) {
          return "--devices gives " + d + " to local ranks " + std::to_string(j) + " and " +
                 std::to_string(i) +
                 "; each rank needs its own GPU, or add --share-devices to share it over Gloo "
                 "(testing)";
        }
      }
    }
    cuda.push_back(d == "cpu" ? "" : d);
    config.devices[static_cast<size_t>(i)] = d;  // resolved: an elastic job passes subsets
  }
  return "";
}

int launch(const LaunchConfig& config) {
  if (pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    say(std::string("cannot create the signal pipe: ") + std::strerror(errno));
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  struct sigaction child {};
  child.sa_handler = onSignal;  // wakes the supervision loop the moment a rank ends
  sigemptyset(&child.sa_mask);
  child.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigaction(SIGCHLD, &child, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const int world = config.nnodes * config.nprocPerNode;
  if (config.nprocPerNode > 1 && !std::getenv("OMP_NUM_THREADS")) {
    say("setting OMP_NUM_THREADS=1 for each rank (set it yourself to choose another value)");
  }
  if (config.minProcs > 0) {
    return detail::launchElastic(config);
  }
  int result = 0;
  for (int attempt = 0; attempt <= config.maxRestarts; ++attempt) {
    const int port = config.masterPort > 0 ? config.masterPort : freePort();
    say("starting " + std::to_string(config.nprocPerNode) + " rank(s) of " + std::to_string(world) +
        " (node " + std::to_string(config.nodeRank) + "/" + std::to_string(config.nnodes) +
        "), store " + config.masterAddr + ":" + std::to_string(port) +
        (attempt > 0 ? ", restart " + std::to_string(attempt) : ""));
    Group group(config, port, attempt);
    if (!group.start()) {
      group.supervise();
      return 1;
    }
    const Group::Outcome outcome = group.supervise();
    result = outcome.exitCode;
    if (result == 0) {
      return 0;
    }
    if (outcome.interrupted) {
      return result >= 128 ? result : 130;
    }
    if (attempt < config.maxRestarts) {
      say("restarting the group (" + std::to_string(attempt + 1) + " of " +
          std::to_string(config.maxRestarts) + " restarts)");
    }
  }
  say("job failed (exit code " + std::to_string(result) + ")");
  return result;
}

}  // namespace run
}  // namespace hddp
