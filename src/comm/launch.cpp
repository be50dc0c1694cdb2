// Reading launcher conventions (torchrun, Slurm, Open MPI) into a LaunchInfo. Pure
// functions of an environment map, so every convention and error is unit-tested.
#include "hddp/comm/launch.h"

#include <cctype>
#include <limits>
#include <map>
#include <set>

#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp_protocol/launch.h"

extern char** environ;  // NOLINT

namespace hddp {
namespace {

// One field's value and the name it came from, for error messages.
struct Field {
  int value = 0;
  std::string from;
};

const std::string* find(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

int intVar(const EnvMap& env, const std::string& name) {
  const std::string* text = find(env, name);
  HDDP_INTERNAL_ASSERT(text, name, " looked up without being present");
  const int64_t v = env::parseInt(name, *text);
  HDDP_CHECK_AS(ConfigError, v >= 0 && v <= (1 << 30), name, "=", *text,
                " is out of range; it must be a non-negative rank or count");
  return static_cast<int>(v);
}

std::optional<Field> optionalInt(const EnvMap& env, const std::string& name) {
  if (!find(env, name)) {
    return std::nullopt;
  }
  return Field{intVar(env, name), name};
}

Field requiredInt(const EnvMap& env, const std::string& name, const std::string& because) {
  HDDP_CHECK_AS(ConfigError, find(env, name), name, " is not set but ", because,
                "; the launcher should set both (or unset both for a single process)");
  return Field{intVar(env, name), name};
}

// "4", "4(x2)" or "4(x2),3" -> 4 (the count on the first node, which is ours when
// SLURM_NODEID is 0; Slurm's tasks-per-node lists are per node in order).
std::optional<int> firstCount(const std::string& name, const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    ++i;
  }
  if (i == 0) {
    return std::nullopt;
  }
  const int64_t n = env::parseInt(name, text.substr(0, i));
  HDDP_CHECK_AS(ConfigError, n <= std::numeric_limits<int>::max(), name, "='", text, "': ", n,
                " tasks per node is out of range");
  return static_cast<int>(n);
}

// Whether hddp-run's own variables (HDDP_LAUNCHER, HDDP_RANK_PREFIXED) describe this
// process: only while TORCHELASTIC_RUN_ID is still the one hddp-run set. A launcher
// started under hddp-run (a script running torchrun) passes them on to its workers, but
// sets its own TORCHELASTIC_RUN_ID; those workers are its, not hddp-run's.
bool fromHddpRunItself(const EnvMap& env) {
  const std::string* stamp = find(env, protocol::kEnvLauncherRunId);
  const std::string* runId = find(env, protocol::kEnvRunId);
  return stamp && runId && *stamp == *runId;
}

}  // namespace

const char* launcherName(Launcher launcher) noexcept {
  switch (launcher) {
    case Launcher::Explicit:
      return "explicit options";
    case Launcher::Torchrun:
      return "torchrun";
    case Launcher::Slurm:
      return "slurm";
    case Launcher::OpenMpi:
      return "openmpi";
    case Launcher::Single:
      return "single process";
    case Launcher::HddpRun:
      return "hddp-run";
  }
  return "?";
}

EnvMap processEnvironment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq != std::string::npos) {
      env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
    }
  }
  return env;
}

/// First host of a Slurm node list: "gpu[01-04,07],login1" -> "gpu01", "a,b" -> "a".
std::string firstSlurmHost(const std::string& nodelist) {
  std::string prefix;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',' && nodelist[i] != '[') {
    prefix += nodelist[i++];
  }
  if (i < nodelist.size() && nodelist[i] == '[') {
    ++i;
    std::string first;
    while (i < nodelist.size() && nodelist[i] != '-' && nodelist[i] != ',' && nodelist[i] != ']') {
      first += nodelist[i++];
    }
    prefix += first;
  }
  return prefix;
}

namespace {

// What a launcher convention (or the options) says, each value with where it came from.
struct Parsed {
  Launcher launcher = Launcher::Single;
  Field rank{0, "default"};
  Field world{1, "default"};
  std::optional<Field> localRank;
  std::optional<Field> localWorld;
  std::optional<std::string> addr;
  std::string addrFrom = "MASTER_ADDR";
  std::optional<int> port;
  std::string portFrom = "MASTER_PORT";
  int restartCount = 0;
  bool useAgentStore = false;

  void masterFrom(const EnvMap& env) {
    if (const std::string* a = find(env, "MASTER_ADDR")) {
      addr = *a;
    }
    if (find(env, "MASTER_PORT")) {
      port = intVar(env, "MASTER_PORT");
    }
  }
};

Parsed fromTorchrun(const EnvMap& env) {
  Parsed p;
  const std::string* launcher = find(env, protocol::kEnvLauncher);
  p.launcher = launcher && *launcher == protocol::kLauncherHddpRun && fromHddpRunItself(env)
                   ? Launcher::HddpRun
                   : Launcher::Torchrun;
  p.rank = requiredInt(env, "RANK", "WORLD_SIZE is");
  p.world = requiredInt(env, "WORLD_SIZE", "RANK is");
  p.localRank = optionalInt(env, "LOCAL_RANK");
  p.localWorld = optionalInt(env, "LOCAL_WORLD_SIZE");
  p.masterFrom(env);
  if (auto restarts = optionalInt(env, protocol::kEnvRestartCount)) {
    p.restartCount = restarts->value;
  }
  if (const std::string* agent = find(env, "TORCHELASTIC_USE_AGENT_STORE")) {
    p.useAgentStore = env::parseBool("TORCHELASTIC_USE_AGENT_STORE", *agent);
  }
  return p;
}

Parsed fromSlurm(const EnvMap& env) {
  Parsed p;
  p.launcher = Launcher::Slurm;
  p.rank = requiredInt(env, "SLURM_PROCID", "this looks like a Slurm step");
  p.world = requiredInt(env, "SLURM_NTASKS", "SLURM_PROCID is");
  p.localRank = optionalInt(env, "SLURM_LOCALID");
  for (const char* name : {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    if (const std::string* text = find(env, name)) {
      if (auto n = firstCount(name, *text)) {
        p.localWorld = Field{*n, name};
        break;
      }
    }
  }
  if (!p.localWorld) {
    const std::string* nodes = find(env, "SLURM_JOB_NUM_NODES");
    if (!nodes) {
      nodes = find(env, "SLURM_NNODES");
    }
    if (nodes && env::parseInt("SLURM_JOB_NUM_NODES", *nodes) == 1) {
      p.localWorld = Field{p.world.value, "SLURM_NTASKS (single node)"};
    }
  }
  p.masterFrom(env);
  if (!p.addr) {
    if (const std::string* ip = find(env, "SLURM_LAUNCH_NODE_IPADDR")) {
      p.addr = *ip;
      p.addrFrom = "SLURM_LAUNCH_NODE_IPADDR";
    } else if (const std::string* list = find(env, "SLURM_JOB_NODELIST")) {
      p.addr = firstSlurmHost(*list);
      p.addrFrom = "SLURM_JOB_NODELIST";
    } else if (const std::string* list2 = find(env, "SLURM_NODELIST")) {
      p.addr = firstSlurmHost(*list2);
      p.addrFrom = "SLURM_NODELIST";
    }
  }
  if (!p.port) {
    if (const std::string* job = find(env, "SLURM_JOB_ID")) {
      // A port per job, so two jobs sharing a node do not collide.
      p.port = 20000 + static_cast<int>(env::parseInt("SLURM_JOB_ID", *job) % 10000);
      p.portFrom = "SLURM_JOB_ID";
    }
  }
  return p;
}

Parsed fromOpenMpi(const EnvMap& env) {
  Parsed p;
  p.launcher = Launcher::OpenMpi;
  p.rank = requiredInt(env, "OMPI_COMM_WORLD_RANK", "this looks like an Open MPI launch");
  p.world = requiredInt(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is");
  p.localRank = optionalInt(env, "OMPI_COMM_WORLD_LOCAL_RANK");
  p.localWorld = optionalInt(env, "OMPI_COMM_WORLD_LOCAL_SIZE");
  p.masterFrom(env);
  p.addrFrom = "MASTER_ADDR (pass it with mpirun -x MASTER_ADDR=<host of rank 0>)";
  p.portFrom = "MASTER_PORT (pass it with mpirun -x MASTER_PORT=<free port>)";
  return p;
}

// The first convention present in `env`, by precedence; a single process without one.
Parsed fromEnvironment(const EnvMap& env) {
  if (find(env, "RANK") || find(env, "WORLD_SIZE")) {
    return fromTorchrun(env);
  }
  if (find(env, "SLURM_PROCID")) {
    return fromSlurm(env);
  }
  if (find(env, "OMPI_COMM_WORLD_RANK")) {
    return fromOpenMpi(env);
  }
  return Parsed{};
}

// Explicit options win over every convention.
void applyOptions(const InitOptions& options, Parsed& p) {
  if (options.rank) {
    p.rank = Field{*options.rank, "option rank"};
  }
  if (options.worldSize) {
    p.world = Field{*options.worldSize, "option worldSize"};
  }
  if (options.rank && options.worldSize) {
    p.launcher = Launcher::Explicit;
  }
  if (options.localRank) {
    p.localRank = Field{*options.localRank, "option localRank"};
  }
  if (options.localWorldSize) {
    p.localWorld = Field{*options.localWorldSize, "option localWorldSize"};
  }
  if (options.masterAddr) {
    p.addr = *options.masterAddr;
    p.addrFrom = "option masterAddr";
  }
  if (options.masterPort) {
    p.port = *options.masterPort;
    p.portFrom = "option masterPort";
  }
}

// Checks the values against each other, naming where each came from.
LaunchInfo validated(Parsed p) {
  const Field& rank = p.rank;
  const Field& world = p.world;
  HDDP_CHECK_AS(ConfigError, world.value >= 1, world.from, "=", world.value,
                " is not a valid world size; it must be at least 1");
  HDDP_CHECK_AS(ConfigError, rank.value >= 0 && rank.value < world.value, rank.from, "=",
                rank.value, " is not below ", world.from, "=", world.value,
                "; ranks run from 0 to ", world.value - 1);
  if (!p.localRank) {
    // Without local information assume one node (the usual hand-set case).
    p.localRank = Field{rank.value, rank.from + " (no local rank given)"};
  }
  if (!p.localWorld) {
    p.localWorld = Field{std::max(world.value, p.localRank->value + 1),
                         world.from + " (no local world size given)"};
  }
  const Field& localRank = *p.localRank;
  const Field& localWorld = *p.localWorld;
  HDDP_CHECK_AS(ConfigError, localWorld.value >= 1 && localWorld.value <= world.value,
                localWorld.from, "=", localWorld.value, " must be between 1 and ", world.from, "=",
                world.value);
  HDDP_CHECK_AS(ConfigError, localRank.value >= 0 && localRank.value < localWorld.value,
                localRank.from, "=", localRank.value, " is not below ", localWorld.from, "=",
                localWorld.value);
  if (world.value > 1) {
    HDDP_CHECK_AS(ConfigError, p.addr && !p.addr->empty(), p.addrFrom, " is not set but ",
                  world.from, "=", world.value,
                  ": ranks need the address of rank 0 to meet; set MASTER_ADDR");
    HDDP_CHECK_AS(ConfigError, p.port.has_value(), p.portFrom, " is not set but ", world.from, "=",
                  world.value, ": set MASTER_PORT to a free TCP port on rank 0's host");
  }
  LaunchInfo info;
  if (p.port) {
    HDDP_CHECK_AS(ConfigError, *p.port > 0 && *p.port < 65536, p.portFrom, "=", *p.port,
                  " is not a TCP port (1..65535)");
    info.masterPort = *p.port;
  }
  if (p.addr) {
    info.masterAddr = *p.addr;
  }
  info.rank = rank.value;
  info.worldSize = world.value;
  info.localRank = localRank.value;
  info.localWorldSize = localWorld.value;
  info.restartCount = p.restartCount;
  info.useAgentStore = p.useAgentStore;
  info.launcher = p.launcher;
  return info;
}

// What the launcher says about the job, whatever the launcher: the slot, the restarts
// (torchrun's count, else Slurm's, the first that is positive), the elastic job, and
// whether the launcher prefixes the rank's lines.
void readJob(const EnvMap& env, LaunchInfo& info) {
  if (find(env, protocol::kEnvSlot)) {
    info.slot = intVar(env, protocol::kEnvSlot);
  }
  info.jobRestarts = 0;
  for (const char* name : {protocol::kEnvRestartCount, "SLURM_RESTART_COUNT"}) {
    if (find(env, name)) {
      const int n = intVar(env, name);
      if (n > 0) {
        info.jobRestarts = n;
        break;
      }
    }
  }
  if (const std::string* on = find(env, protocol::kEnvElastic)) {
    info.elastic = *on == "1";
  }
  if (const std::string* dir = find(env, protocol::kEnvElasticDir)) {
    info.elasticDir = *dir;
  }
  const std::string* prefixed = find(env, protocol::kEnvRankPrefixed);
  info.rankPrefixed = prefixed && *prefixed == "1" && fromHddpRunItself(env);
}

}  // namespace

LaunchInfo detectLaunch(const InitOptions& options, const EnvMap& env) {
  Parsed parsed = fromEnvironment(env);
  applyOptions(options, parsed);
  LaunchInfo info = validated(std::move(parsed));
  readJob(env, info);
  return info;
}

LaunchInfo detectJob(const EnvMap& env) {
  LaunchInfo info;
  readJob(env, info);
  return info;
}

}  // namespace hddp
