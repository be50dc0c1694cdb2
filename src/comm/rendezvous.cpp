#include "hddp/comm/rendezvous.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <exception>
#include <random>
#include <thread>
#include <tuple>

#include "comm/loopback.h"
#include "comm/round.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/fault.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

std::string hostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) {
    return "unknown-host";
  }
  return buf;
}

// The backend this rank was asked for and by whom ("auto" and "" when not asked).
std::pair<std::string, std::string> requestedBackend(const InitOptions& options) {
  if (options.backend) {
    return {backendName(*options.backend), "InitOptions::backend"};
  }
  const auto requested = env::resolveString("HDDP_BACKEND");
  std::string value = requested.value;
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (value.empty() || value == "auto") {
    return {"auto", ""};
  }
  parseBackend(value);  // an unknown name is an error here, on the rank that has it
  return {value, "HDDP_BACKEND"};
}

}  // namespace

std::string agreeOnRound(Store& store, int rank, int worldSize, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto late = [&] { return std::chrono::steady_clock::now() >= deadline; };
  const std::string current = "hddp/round";
  if (rank == 0) {
    char nonce[48];
    std::random_device device;
    std::snprintf(nonce, sizeof(nonce), "%08x%08x-%d", device(), device(),
                  static_cast<int>(getpid()));
    const std::string round = nonce;
    const std::string joined = current + "/" + round + "/joined";
    store.set(current, round);
    while (store.add(joined, 0) < worldSize - 1) {
      HDDP_CHECK_AS(DistributedError, !late(), "rendezvous: only ", store.add(joined, 0), " of ",
                    worldSize - 1, " other ranks joined round ", round, " within ",
                    timeout.count() / 1000, " s on ", store.description(),
                    "; check that every rank is running and reachable, or raise the timeout "
                    "(HDDP_TIMEOUT_SEC)");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    store.set(current + "/" + round + "/go", std::string("1"));
    return round;
  }
  // A round already announced as complete ("go") before this rank joined belongs to an
  // earlier generation: wait for rank 0 to announce this one.
  std::string joinedRound;
  while (true) {
    HDDP_CHECK_AS(DistributedError, !late(), "rendezvous: rank 0 did not announce a round ",
                  "within ", timeout.count() / 1000, " s on ", store.description(),
                  "; check that rank 0 is running, or raise the timeout (HDDP_TIMEOUT_SEC)");
    if (store.check({current})) {
      const std::string round = store.getString(current);
      const std::string go = current + "/" + round + "/go";
      if (round == joinedRound) {
        if (store.check({go})) {
          return round;
        }
      } else if (!store.check({go})) {
        store.add(current + "/" + round + "/joined", 1);
        joinedRound = round;
        continue;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

std::vector<RankDeviceClaim> exchangeDeviceClaims(Store& store, int rank, int worldSize,
                                                  const RankDeviceClaim& mine,
                                                  const std::string& round,
                                                  std::chrono::milliseconds timeout) {
  const std::string prefix = "hddp/device_claim/" + round + "/";
  store.set(prefix + std::to_string(rank), mine.encode());
  std::vector<std::string> keys;
  for (int r = 0; r < worldSize; ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  store.wait(keys, timeout);
  std::vector<RankDeviceClaim> claims;
  for (const auto& key : keys) {
    claims.push_back(RankDeviceClaim::decode(store.getString(key)));
  }
  // Rank 0 hosts the store: it leaves only when every rank has read the claims, so that
  // when they make the job fail, each rank fails with their reason, not with a store
  // that went away.
  store.add(prefix + "read", 1);
  if (rank == 0) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (store.add(prefix + "read", 0) < worldSize &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return claims;
}

DistributedContext initFromEnv(const InitOptions& options) {
  const LaunchInfo info = detectLaunch(options, processEnvironment());
  if (info.slot >= 0) {
    // hddp-run's elastic job asks for a re-form with SIGUSR1; the Trainer answers it at
    // its next commit. A program without the Trainer ignores it instead of dying.
    struct sigaction current {};
    if (sigaction(SIGUSR1, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGUSR1, SIG_IGN);
    }
  }
  log::setRank(info.rank);
  log::setLauncherPrefixesRank(info.rankPrefixed);  // hddp-run's "[rank N] " is enough
  const bool allowShared =
      env::resolveBool("HDDP_ALLOW_SHARED_DEVICE", options.allowSharedDevice).value;

  const int cudaCount = at::detail::getCUDAHooks().hasCUDA()
                            ? static_cast<int>(at::detail::getCUDAHooks().deviceCount())
                            : 0;
  // A rank whose own device or backend wish is wrong still joins the exchange with its
  // error, so every rank fails with it at once instead of waiting for the timeout.
  RankDeviceClaim mine;
  mine.host = hostName();
  mine.ncclAvailable = ncclAvailable();
  mine.allowShared = allowShared;
  c10::Device device(c10::kCPU);
  std::exception_ptr localError;
  try {
    device = resolveDevice(info, options.device, processEnvironment(), cudaCount, allowShared);
    std::tie(mine.requested, mine.requestedFrom) = requestedBackend(options);
  } catch (const ConfigError& e) {
    localError = std::current_exception();
    mine.error = e.what_without_backtrace();
  }
  mine.device = device.str();

  // Until the backend is agreed, the store waits as long as the backend the rank would
  // pick alone allows (a rank on CUDA: NCCL's 10 minutes).
  std::chrono::milliseconds explicitTimeout{0};
  if (options.timeout) {
    explicitTimeout = *options.timeout;
  } else if (const auto sec = env::timeoutFromEnv(); sec.count() > 0) {
    explicitTimeout = sec;
  }
  const bool guessNccl = mine.requested == "nccl" || (mine.requested == "auto" && device.is_cuda());
  const std::chrono::milliseconds storeTimeout =
      explicitTimeout.count() > 0 ? explicitTimeout
                                  : defaultTimeout(guessNccl ? Backend::Nccl : Backend::Gloo);

  // Keys of this generation: a launcher's restart count, which every rank shares; under
  // torchrun's agent (which sets TORCHELASTIC_USE_AGENT_STORE, "True" or "False") each
  // agent counts its own failures (a node that joins counts none), so there it is the
  // store of the generation that tells them apart: rank 0's own, or a round agreed on the
  // agent's (below).
  const EnvMap environment = processEnvironment();
  const bool torchrunAgent = environment.count("TORCHELASTIC_USE_AGENT_STORE") > 0;
  std::string round = torchrunAgent ? std::string("torchrun") : std::to_string(info.restartCount);
  auto makeStore = [&]() -> Store {
    if (info.worldSize == 1 && !info.useAgentStore) {
      return Store::memory(storeTimeout);
    }
    TcpStoreOptions opts;
    opts.host = info.masterAddr;
    opts.port = static_cast<uint16_t>(info.masterPort);
    opts.timeout = storeTimeout;
    if (info.useAgentStore) {
      // torchrun's agent keeps one store through its rendezvous rounds, and a membership
      // change leaves the restart count (which only failures raise, each agent its own):
      // the ranks agree on a round of their own, whose keys are theirs alone.
      opts.isServer = false;
      Store agent = Store::tcp(opts);
      round = agreeOnRound(agent, info.rank, info.worldSize, storeTimeout);
      return agent.withPrefix("/hddp/" + round);
    }
    opts.isServer = info.rank == 0;
    opts.worldSize = info.worldSize;
    return Store::tcp(opts);
  };
  fault::armStore(info.rank, info.jobRestarts, info.slot);  // HDDP_FAULT's store=N
  Store store = makeStore();

  // Every rank's device and wishes, so that all derive one backend (or one error) and
  // the "Duplicate GPU detected" trap is caught before NCCL would hang or crash on it.
  std::vector<RankDeviceClaim> claims{mine};
  try {
    if (info.worldSize > 1) {
      claims = exchangeDeviceClaims(store, info.rank, info.worldSize, mine, round, storeTimeout);
    }
  } catch (const Error&) {
    if (!localError) {
      throw;
    }
  }
  if (localError) {
    std::rethrow_exception(localError);  // this rank's own reason comes first
  }
  const BackendAgreement agreed = agreeOnBackend(claims);
  const Backend backend = agreed.backend;
  const std::chrono::milliseconds timeout =
      explicitTimeout.count() > 0 ? explicitTimeout : defaultTimeout(backend);

  HDDP_LOG_INFO("comm", "rank ", info.rank, "/", info.worldSize, " (local ", info.localRank, "/",
                info.localWorldSize, ") from ", launcherName(info.launcher), ", device ", device,
                ", backend ", backendName(backend), " for the job: ", agreed.reason,
                info.worldSize > 1 ? c10::str(", store ", info.masterAddr, ":", info.masterPort)
                                   : std::string());

  CommunicatorOptions commOptions;
  commOptions.backend = backend;
  commOptions.timeout = timeout;
  commOptions.device = device;
  if (detail::isLoopbackAddress(info.masterAddr)) {
    commOptions.glooHostname = "127.0.0.1";  // one node: nothing listens beyond loopback
  } else if (info.worldSize > 1 && backend == Backend::Gloo) {
    HDDP_LOG_INFO("comm",
                  "Gloo listens on the address of this host's name (or "
                  "HDDP_GLOO_INTERFACE); keep multi-node jobs on a private network "
                  "(docs/launching.md)");
  }
  if (!device.is_cpu()) {
    // As torch.cuda.set_device(local_rank): rank 1 on cuda:1 would otherwise put what
    // takes the current device (and a CUDA context) on cuda:0, another rank's card.
    c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
  }
  auto communicator = makeCommunicator(store, info.rank, info.worldSize, commOptions);
  fault::disarmStore();  // store=N counts the operations of joining only
  return DistributedContext{info, device, store, std::move(communicator)};
}

}  // namespace hddp
