// Which device each rank uses, and the one backend the whole job agrees on.
//
// A rank's device comes from, in this order: InitOptions::device (the trainers'
// --device); HDDP_DEVICE (hddp-run --devices sets it), either one device for every
// local rank or a list with one entry per local rank ("cuda:0,cpu"); else
// cuda:<local rank> when CUDA is present, otherwise the CPU.
//
// At rendezvous every rank publishes a claim (host, device, whether its LibTorch has
// NCCL, the backend it was asked for) and every rank derives the same backend from all
// claims: NCCL only when every rank is on its own CUDA device, otherwise Gloo for all
// (CUDA tensors staged through pinned host memory). An explicit backend that cannot
// serve the job, or ranks asking for different ones, is a ConfigError on every rank.
// These are pure functions, so every rule and message is unit-tested without a GPU.
#pragma once

#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/comm/launch.h"

namespace hddp {

/// "cpu", "cuda" (index unset) or "cuda:N", case-insensitive, spaces trimmed. Throws
/// hddp::ConfigError naming `source` (e.g. "--device") and the text otherwise.
c10::Device parseDeviceName(const std::string& text, const std::string& source);

/// A comma-separated device list ("cuda:0,cpu"); a bare "cuda" in it takes the next
/// CUDA index in the list's order ("cuda,cpu,cuda" = cuda:0, cpu, cuda:1). Throws
/// hddp::ConfigError naming `source` and the entry when one is not a device.
std::vector<c10::Device> parseDeviceList(const std::string& text, const std::string& source);

/// The device this rank should use when none is given: cuda:<localRank> when
/// `cudaDeviceCount` > 0, else CPU. localRank >= cudaDeviceCount throws
/// hddp::ConfigError unless `allowShared` (then devices are reused round-robin).
c10::Device chooseDevice(const LaunchInfo& info, int cudaDeviceCount, bool allowShared = false);

/// This rank's device: `explicitDevice`, else HDDP_DEVICE from `env` (one device for
/// every local rank, or one per local rank), else chooseDevice(). A CUDA device must be
/// present (index below `cudaDeviceCount`); errors name the rank, the device and where
/// it came from.
c10::Device resolveDevice(const LaunchInfo& info, const std::optional<c10::Device>& explicitDevice,
                          const EnvMap& env, int cudaDeviceCount, bool allowShared = false);

/// Checks that no two ranks on one host use the same CUDA device; `claims` are
/// "host|device" strings indexed by rank. Throws hddp::ConfigError naming both ranks.
void checkDistinctDevices(const std::vector<std::string>& claims);

/// What a rank tells the others at rendezvous.
struct RankDeviceClaim {
  std::string host;
  std::string device;  // "cpu", "cuda:0"
  bool ncclAvailable = false;
  /// The backend this rank was asked for: "auto", "gloo" or "nccl".
  std::string requested = "auto";
  /// Where `requested` came from ("HDDP_BACKEND", "InitOptions::backend"; empty: auto).
  std::string requestedFrom;
  /// HDDP_ALLOW_SHARED_DEVICE on this rank.
  bool allowShared = false;
  /// Why this rank cannot join (its device or backend wish is wrong); empty when it can.
  std::string error;

  std::string encode() const;
  /// Throws hddp::CommError on a malformed claim.
  static RankDeviceClaim decode(const std::string& text);
};

struct BackendAgreement {
  Backend backend = Backend::Gloo;
  /// Why, for the log: "every rank is on its own CUDA device", "rank 1 is on cpu", ...
  std::string reason;
};

/// The job's backend from every rank's claim (indexed by rank); the same result, or the
/// same ConfigError, on every rank. A claim with an error makes it a ConfigError that
/// names that rank. Auto: NCCL when every rank is on CUDA, has NCCL and
/// no two ranks of a host share a device; Gloo otherwise. A device shared without every
/// rank allowing it is a ConfigError (checkDistinctDevices).
BackendAgreement agreeOnBackend(const std::vector<RankDeviceClaim>& claims);

}  // namespace hddp
