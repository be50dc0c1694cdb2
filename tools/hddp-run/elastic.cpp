// hddp-run's elastic jobs (--nproc-per-node MIN:MAX; docs/elastic.md): generations of
// ranks over slots, rejoin checks, the emulated unplug.
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "group.h"
#include "hddp_protocol/job_record.h"

namespace hddp {
namespace run {
namespace detail {
namespace {

double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// One local slot of an elastic job: whether it runs a rank, and why not.
struct Slot {
  bool away = false;    // left (failed, unplugged); back only when its check passes
  bool back = false;    // its rejoin check passed: it joins at the next re-forming
  std::string why;      // why it left
  pid_t checkPid = -1;  // a rejoin check in flight
};

// The slot's device as the ranks will see it: entry <slot> of --devices, else the
// default (cuda:<slot> with CUDA, which the check itself finds out).
std::string slotDevice(const LaunchConfig& config, int slot) {
  return config.devices.empty() ? "" : config.devices[static_cast<size_t>(slot)];
}

// Starts the rejoin check of `slot` (asynchronously: a shell command, or hddp-probe
// for a CUDA slot). Returns -1 when the slot needs no check (a CPU slot, no command):
// it is available.
pid_t startRejoinCheck(const LaunchConfig& config, int slot) {
  const std::string device = slotDevice(config, slot);
  std::vector<std::string> argv;
  if (!config.rejoinCheck.empty()) {
    argv = {"/bin/sh", "-c", config.rejoinCheck};
  } else if (device == "cpu" || config.probePath.empty()) {
    return -1;
  } else {
    argv = {config.probePath, "--check-device",
            device.empty() ? "slot:" + std::to_string(slot) : device};
  }
  const pid_t pid = fork();
  if (pid == 0) {
    setenv(protocol::kEnvSlot, std::to_string(slot).c_str(), 1);
    setenv("HDDP_SLOT_DEVICE", device.c_str(), 1);
    const int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      dup2(devnull, STDOUT_FILENO);
    }
    std::vector<char*> args;
    for (auto& a : argv) {
      args.push_back(const_cast<char*>(a.c_str()));
    }
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

std::string makeElasticDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/hddp-elastic-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  return mkdtemp(buf.data()) ? std::string(buf.data()) : std::string();
}

// The job's folder: --job-dir (created; refused when it holds an earlier job's record),
// else a new temporary one. Returns "" after saying why there is none.
std::string jobFolder(const LaunchConfig& config) {
  if (config.jobDir.empty()) {
    const std::string dir = makeElasticDir();
    if (dir.empty()) {
      say(std::string("cannot create the elastic job's folder: ") + std::strerror(errno));
    }
    return dir;
  }
  std::error_code ec;
  std::filesystem::create_directories(config.jobDir, ec);
  if (ec) {
    say("--job-dir " + config.jobDir + ": cannot create it: " + ec.message());
    return "";
  }
  if (std::filesystem::exists(config.jobDir + "/" + protocol::kJobRecordFile, ec)) {
    say("--job-dir " + config.jobDir +
        " holds an earlier job's record (job.jsonl): give an empty or new folder");
    return "";
  }
  return config.jobDir;
}

// Ends the job: records how, prints the record's summary when anything happened, and
// removes a temporary folder of a job that succeeded.
int finish(const LaunchConfig& config, const std::string& dir, int generation, int code,
           const std::string& why) {
  jobrecord::append(dir, "end", generation, {{"code", code}, {"why", why}});
  try {
    const jobrecord::Job job = jobrecord::read(dir);
    if (job.generations.size() > 1 || code != 0) {
      for (const auto& line : jobrecord::describe(job, jobrecord::unixNow())) {
        say(line);
      }
    }
  } catch (const std::exception& e) {
    say(std::string("no summary: ") + e.what());
  }
  if (code == 0 && config.jobDir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  } else {
    say("the job's folder stays: " + dir + " (hddp-probe --job " + dir + ")");
  }
  return code;
}

}  // namespace

int launchElastic(const LaunchConfig& config) {
  const auto jobStart = std::chrono::steady_clock::now();
  std::vector<Slot> slots(static_cast<size_t>(config.nprocPerNode));
  std::vector<bool> unplugDone(config.unplugs.size(), false);
  const std::string dir = jobFolder(config);
  if (dir.empty()) {
    return 1;
  }
  say("elastic: " + std::to_string(config.minProcs) + " to " + std::to_string(config.nprocPerNode) +
      " ranks; commits in " + dir +
      " unless the program saves elsewhere (--save-dir); hddp-probe --job " + dir +
      " shows the job");
  jobrecord::append(dir, "job", 0,
                    {{"min", config.minProcs},
                     {"max", config.nprocPerNode},
                     {"pid", static_cast<long>(getpid())}});
  for (const auto& u : config.unplugs) {
    say("emulation: slot " + std::to_string(u.slot) + " is unplugged " + std::to_string(u.at) +
        " s after the start" +
        (u.back >= 0 ? " and back " + std::to_string(u.back) + " s after the start"
                     : ", for good"));
  }
  int failures = 0;
  for (int generation = 0;; ++generation) {
    std::vector<int> active;
    std::string awayText;
    for (int i = 0; i < config.nprocPerNode; ++i) {
      Slot& slot = slots[static_cast<size_t>(i)];
      if (slot.back) {
        slot = Slot{};
      }
      if (!slot.away) {
        active.push_back(i);
      } else {
        awayText += "; slot " + std::to_string(i) + ": " + slot.why;
      }
    }
    if (static_cast<int>(active.size()) < config.minProcs) {
      say("only " + std::to_string(active.size()) + " of " + std::to_string(config.nprocPerNode) +
          " slots can run a rank, fewer than the minimum " + std::to_string(config.minProcs) +
          awayText + "; ending the job");
      say("job failed (exit code 1)");
      return finish(config, dir, generation, 1,
                    "fewer than the minimum " + std::to_string(config.minProcs) + " slots");
    }
    const int port = config.masterPort > 0 ? config.masterPort : freePort();
    std::string slotList;
    for (int a : active) {
      slotList += (slotList.empty() ? "" : ",") + std::to_string(a);
    }
    say("generation " + std::to_string(generation) + ": " + std::to_string(active.size()) +
        " rank(s) on slots " + slotList + ", store " + config.masterAddr + ":" +
        std::to_string(port));
    std::error_code ec;
    std::filesystem::remove(dir + "/" + protocol::kReformFile,
                            ec);  // the last generation's request is met
    jobrecord::append(dir, "generation", generation, {{"slots", active}, {"port", port}});
    Group group(config, port, generation, active, dir);
    if (!group.start()) {
      group.supervise();
      return finish(config, dir, generation, 1, "the ranks could not be started");
    }
    auto lastCheck = std::chrono::steady_clock::now();
    const Group::Outcome outcome = group.supervise([&](Group& g) {
      const double now = secondsSince(jobStart);
      for (size_t u = 0; u < config.unplugs.size(); ++u) {
        const auto& unplug = config.unplugs[u];
        if (!unplugDone[u] && now >= unplug.at) {
          unplugDone[u] = true;
          if (g.killSlot(unplug.slot, SIGKILL)) {
            jobrecord::append(dir, "unplug", generation, {{"slot", unplug.slot}});
            say("emulation: unplugging slot " + std::to_string(unplug.slot) + " (rank " +
                std::to_string(g.rankOfSlot(unplug.slot)) + ") at " + std::to_string(now) + " s");
          }
        }
      }
      // Rejoin checks of the slots that left, every rejoinEvery seconds.
      for (int i = 0; i < config.nprocPerNode; ++i) {
        Slot& slot = slots[static_cast<size_t>(i)];
        if (slot.checkPid > 0) {
          int status = 0;
          if (waitpid(slot.checkPid, &status, WNOHANG) == slot.checkPid) {
            slot.checkPid = -1;
            slot.back = WIFEXITED(status) && WEXITSTATUS(status) == 0;
          }
        }
      }
      if (g.reformRequested() || secondsSince(lastCheck) < config.rejoinEvery) {
        return;
      }
      lastCheck = std::chrono::steady_clock::now();
      std::string backList;
      for (int i = 0; i < config.nprocPerNode; ++i) {
        Slot& slot = slots[static_cast<size_t>(i)];
        if (!slot.away || slot.checkPid > 0) {
          continue;
        }
        bool emulatedAway = false;
        for (const auto& u : config.unplugs) {
          emulatedAway =
              emulatedAway || (u.slot == i && now >= u.at && (u.back < 0 || now < u.back));
        }
        if (!slot.back && !emulatedAway) {
          slot.checkPid = startRejoinCheck(config, i);
          slot.back = slot.checkPid < 0;
        }
        if (slot.back) {
          backList += (backList.empty() ? "" : ",") + std::to_string(i);
        }
      }
      if (!backList.empty()) {
        std::vector<int> back;
        for (int i = 0; i < config.nprocPerNode; ++i) {
          if (slots[static_cast<size_t>(i)].away && slots[static_cast<size_t>(i)].back) {
            back.push_back(i);
          }
        }
        jobrecord::append(dir, "back", generation, {{"slots", back}});
        say("slot(s) " + backList + " can run again " + std::to_string(now) +
            " s after the start; the group re-forms with them at the next commit");
        g.requestReform();
      }
    });
    if (outcome.interrupted) {
      return finish(config, dir, generation, outcome.exitCode >= 128 ? outcome.exitCode : 130,
                    "interrupted by a signal");
    }
    if (outcome.exitCode == 0 && !outcome.reform) {
      say("job done after " + std::to_string(generation + 1) + " generation(s), " +
          std::to_string(secondsSince(jobStart)) + " s");
      return finish(config, dir, generation, 0, "");
    }
    if (outcome.reform) {
      jobrecord::append(dir, "reform", generation);
      say("the ranks committed and left to re-form the group");
      continue;
    }
    if (outcome.usageError) {
      // A configuration error or a rejected flag, the same on every rank: no member
      // can run the program as given, so re-forming would only fail again.
      const auto& [slot, why] = outcome.failed.front();
      say("slot " + std::to_string(slot) + ": " + why +
          ", a usage error (the program's message is above); re-forming cannot fix it, so "
          "the job ends");
      say("job failed (exit code " + std::to_string(outcome.exitCode) + ")");
      return finish(config, dir, generation, outcome.exitCode, "usage error: " + why);
    }
    for (const auto& [slot, why] : outcome.failed) {
      Slot& s = slots[static_cast<size_t>(slot)];
      s.away = true;
      s.back = false;
      s.why = why;
      jobrecord::append(dir, "left", generation, {{"slot", slot}, {"why", why}});
      say("slot " + std::to_string(slot) + " left: " + why);
    }
    if (++failures > config.maxRestarts) {
      const std::string why = std::to_string(failures) + " failure(s), more than --max-restarts " +
                              std::to_string(config.maxRestarts);
      say("job failed (exit code " + std::to_string(outcome.exitCode) + "): " + why);
      return finish(config, dir, generation, outcome.exitCode, why);
    }
    say("re-forming without the slot(s) that left (" + std::to_string(failures) + " of " +
        std::to_string(config.maxRestarts) + " failures allowed)");
  }
}

}  // namespace detail
}  // namespace run
}  // namespace hddp
