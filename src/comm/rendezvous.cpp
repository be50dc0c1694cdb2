#include "hddp/comm/rendezvous.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <exception>
#include <thread>
#include <tuple>

#include "comm/loopback.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
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

  auto makeStore = [&]() -> Store {
    if (info.worldSize == 1 && !info.useAgentStore) {
      return Store::memory(storeTimeout);
    }
    TcpStoreOptions opts;
    opts.host = info.masterAddr;
    opts.port = static_cast<uint16_t>(info.masterPort);
    opts.timeout = storeTimeout;
    if (info.useAgentStore) {
      opts.isServer = false;
      return Store::tcp(opts).withPrefix("/worker/attempt_" + std::to_string(info.restartCount));
    }
    opts.isServer = info.rank == 0;
    opts.worldSize = info.worldSize;
    return Store::tcp(opts);
  };
  Store store = makeStore();

  // Every rank's device and wishes, so that all derive one backend (or one error) and
  // the "Duplicate GPU detected" trap is caught before NCCL would hang or crash on it.
  std::vector<RankDeviceClaim> claims{mine};
  try {
    if (info.worldSize > 1) {
      claims = exchangeDeviceClaims(store, info.rank, info.worldSize, mine,
                                    std::to_string(info.restartCount), storeTimeout);
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
  return DistributedContext{info, device, store, std::move(communicator)};
}

}  // namespace hddp
