#include "hddp/comm/rendezvous.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <unistd.h>

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

Backend chooseBackend(const InitOptions& options, const c10::Device& device, bool shared) {
  if (options.backend) {
    return *options.backend;
  }
  const auto requested = env::resolveString("HDDP_BACKEND");
  if (requested.value != "auto" && !requested.value.empty()) {
    return parseBackend(requested.value);
  }
  return device.is_cuda() && ncclAvailable() && !shared ? Backend::Nccl : Backend::Gloo;
}

}  // namespace

DistributedContext initFromEnv(const InitOptions& options) {
  const LaunchInfo info = detectLaunch(options, processEnvironment());
  log::setRank(info.rank);
  const bool allowShared =
      env::resolveBool("HDDP_ALLOW_SHARED_DEVICE", options.allowSharedDevice).value;

  const int cudaCount = at::detail::getCUDAHooks().hasCUDA()
                            ? static_cast<int>(at::detail::getCUDAHooks().deviceCount())
                            : 0;
  const c10::Device device =
      options.device ? *options.device : chooseDevice(info, cudaCount, allowShared);
  const Backend backend = chooseBackend(options, device, allowShared);
  HDDP_CHECK_AS(ConfigError, backend != Backend::Nccl || device.is_cuda(),
                "the NCCL backend needs a CUDA device but this rank uses ", device,
                "; use HDDP_BACKEND=gloo (or leave it on auto)");
  std::chrono::milliseconds timeout{0};
  if (options.timeout) {
    timeout = *options.timeout;
  } else if (const auto sec = env::timeoutFromEnv(); sec.count() > 0) {
    timeout = sec;
  } else {
    timeout = defaultTimeout(backend);
  }

  HDDP_LOG_INFO("comm", "rank ", info.rank, "/", info.worldSize, " (local ", info.localRank, "/",
                info.localWorldSize, ") from ", launcherName(info.launcher), ", device ", device,
                ", backend ", backendName(backend),
                info.worldSize > 1 ? c10::str(", store ", info.masterAddr, ":", info.masterPort)
                                   : std::string());

  auto makeStore = [&]() -> Store {
    if (info.worldSize == 1 && !info.useAgentStore) {
      return Store::memory(timeout);
    }
    TcpStoreOptions opts;
    opts.host = info.masterAddr;
    opts.port = static_cast<uint16_t>(info.masterPort);
    opts.timeout = timeout;
    if (info.useAgentStore) {
      opts.isServer = false;
      return Store::tcp(opts).withPrefix("/worker/attempt_" + std::to_string(info.restartCount));
    }
    opts.isServer = info.rank == 0;
    opts.worldSize = info.worldSize;
    return Store::tcp(opts);
  };
  Store store = makeStore();

  // The "Duplicate GPU detected" trap, caught before NCCL would hang or crash on it.
  if (info.worldSize > 1 && !allowShared) {
    const std::string prefix = "hddp/device_claim/" + std::to_string(info.restartCount) + "/";
    store.set(prefix + std::to_string(info.rank), hostName() + "|" + device.str());
    std::vector<std::string> keys;
    for (int r = 0; r < info.worldSize; ++r) {
      keys.push_back(prefix + std::to_string(r));
    }
    store.wait(keys, timeout);
    std::vector<std::string> claims;
    for (const auto& key : keys) {
      claims.push_back(store.getString(key));
    }
    checkDistinctDevices(claims);
  }

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
  auto communicator = makeCommunicator(store, info.rank, info.worldSize, commOptions);
  return DistributedContext{info, device, store, std::move(communicator)};
}

}  // namespace hddp
