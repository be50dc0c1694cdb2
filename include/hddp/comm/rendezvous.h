// Where do we meet: joining the job (hddp/comm/launch.h says who is who).
//
// `initFromEnv()` detects the launch (detectLaunch), then connects: rank 0 hosts a
// TCPStore at MASTER_ADDR:MASTER_PORT and the others join it (with
// TORCHELASTIC_USE_AGENT_STORE=True every rank is a client of torchrun's agent store,
// under /worker/attempt_<restart count>), exchanges the ranks' device claims so that
// every rank agrees on one backend (hddp/comm/devices.h) and no two local ranks claim
// one CUDA device, and creates the communicator.
#pragma once

#include <memory>

#include "hddp/comm/communicator.h"
#include "hddp/comm/devices.h"
#include "hddp/comm/launch.h"
#include "hddp/comm/store.h"

namespace hddp {

/// A joined rank: its launch information, device, store and communicator.
struct DistributedContext {
  LaunchInfo info;
  c10::Device device = c10::Device(c10::kCPU);
  Store store;
  std::unique_ptr<Communicator> communicator;

  int rank() const { return info.rank; }
  int worldSize() const { return info.worldSize; }
};

/// Detects the launch, connects to the store and creates the communicator. Sets the
/// log rank, and makes the rank's device (a GPU or emu) the calling thread's current
/// device, as torch.cuda.set_device(local_rank) in a script: another thread of the rank
/// that allocates on the current device must set it too (the Trainer does, for its
/// calls). Blocks until every rank has joined (or throws hddp::TimeoutError).
DistributedContext initFromEnv(const InitOptions& options = {});

/// Publishes `mine` in `store` for round `round` (initFromEnv: the restart count) and
/// returns every rank's claim, indexed by rank; blocks until all have published (or
/// throws hddp::TimeoutError after `timeout`).
std::vector<RankDeviceClaim> exchangeDeviceClaims(Store& store, int rank, int worldSize,
                                                  const RankDeviceClaim& mine,
                                                  const std::string& round,
                                                  std::chrono::milliseconds timeout);

}  // namespace hddp
