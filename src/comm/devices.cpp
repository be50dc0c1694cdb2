// Each rank's device and the backend the job agrees on (see hddp/comm/devices.h).
#include "hddp/comm/devices.h"

#include <c10/core/DeviceType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <sstream>

#include "hddp/core/error.h"

namespace hddp {
namespace {

std::string trimmed(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) {
    return "";
  }
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::vector<std::string> splitOn(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, sep);) {
    parts.push_back(part);
  }
  if (!text.empty() && text.back() == sep) {
    parts.emplace_back();
  }
  return parts;
}

// "rank 1 (local rank 1)" for messages.
std::string whoIs(const LaunchInfo& info) {
  return c10::str("rank ", info.rank, " (local rank ", info.localRank, ")");
}

std::string visibleDevices(int count) {
  if (count <= 0) {
    return "no CUDA device is visible (no driver, a CPU-only LibTorch, or CUDA_VISIBLE_DEVICES "
           "hides them)";
  }
  return c10::str(count, " CUDA device(s) are visible (cuda:0",
                  count > 1 ? c10::str("..cuda:", count - 1) : "", ")");
}

void checkPresent(const c10::Device& device, const LaunchInfo& info, const std::string& source,
                  int cudaDeviceCount) {
  if (device.is_privateuseone()) {
    // An accelerator registered as PrivateUse1 (e.g. hddp::emu): its own device count.
    const int count =
        c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)
            ? c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->deviceCount()
            : 0;
    const int index = device.has_index() ? device.index() : 0;
    HDDP_CHECK_AS(ConfigError, index < count, whoIs(info), " is given ", device, " by ", source,
                  " but this program has ", count, " ", c10::get_privateuse1_backend(),
                  " device(s). Name one of them, or cpu");
    return;
  }
  if (!device.is_cuda()) {
    return;
  }
  const int index = device.has_index() ? device.index() : 0;
  HDDP_CHECK_AS(ConfigError, index < cudaDeviceCount, whoIs(info), " is given ", device, " by ",
                source, " but ", visibleDevices(cudaDeviceCount),
                ". Name a device this machine has (--devices / HDDP_DEVICE / --device), or "
                "cpu");
}

// A bare "cuda" for this rank: cuda:<local rank> as without HDDP_DEVICE (cuda:0 when
// none is visible, which checkPresent then reports).
c10::Device bareCuda(const LaunchInfo& info, int cudaDeviceCount, bool allowShared);

}  // namespace

c10::Device parseDeviceName(const std::string& text, const std::string& source) {
  const std::string t = lower(trimmed(text));
  if (t == "cpu") {
    return c10::Device(c10::kCPU);
  }
  if (t == "cuda") {
    return c10::Device(c10::kCUDA);
  }
  if (t.rfind("cuda:", 0) == 0 && t.size() > 5 && t.size() <= 8 &&
      std::all_of(t.begin() + 5, t.end(), [](unsigned char c) { return std::isdigit(c); })) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(t.substr(5))));
  }
  // An accelerator registered as LibTorch's PrivateUse1 backend, by its name: "emu",
  // "emu:1" for hddp::emu.
  const std::string name = c10::get_privateuse1_backend(/*lower_case=*/true);
  const size_t colon = t.find(':');
  const std::string head = t.substr(0, colon);
  const std::string index = colon == std::string::npos ? "" : t.substr(colon + 1);
  const bool indexOk =
      colon == std::string::npos ||
      (!index.empty() && index.size() <= 3 &&
       std::all_of(index.begin(), index.end(), [](unsigned char c) { return std::isdigit(c); }));
  if (c10::is_privateuse1_backend_registered() && head == name && indexOk) {
    return index.empty() ? c10::Device(c10::DeviceType::PrivateUse1)
                         : c10::Device(c10::DeviceType::PrivateUse1,
                                       static_cast<c10::DeviceIndex>(std::stoi(index)));
  }
  HDDP_CHECK_AS(ConfigError, !(head == "emu" && indexOk), source, ": '", text,
                "' names hddp's emulated accelerator, which this program has not installed: "
                "link hddp::emu and call hddp::emu::install() before choosing devices (the "
                "example trainers and hddp-probe do when a device names emu)");
  HDDP_CHECK_AS(ConfigError, false, source, ": '", text,
                "' is not a device; use cpu, cuda or cuda:N (e.g. cuda:0)",
                c10::is_privateuse1_backend_registered() ? ", or " + name + "[:N]" : "");
  return c10::Device(c10::kCPU);  // not reached
}

namespace {

// Whether `text` reads as hddp::emu's device name ("emu", "emu:N").
bool namesEmu(const std::string& text) {
  const std::string t = lower(trimmed(text));
  if (t == "emu") {
    return true;
  }
  return t.rfind("emu:", 0) == 0 && t.size() > 4 && t.size() <= 7 &&
         std::all_of(t.begin() + 4, t.end(), [](unsigned char c) { return std::isdigit(c); });
}

// parseDeviceList for the rank of entry `rankEntry` (-1: every entry is parsed as its
// own): the other ranks' entries that name hddp::emu are taken as PrivateUse1 devices
// without it being installed here, since only a rank on emu installs it (a CUDA rank next
// to it keeps CUDA's pinned memory).
std::vector<c10::Device> parseDeviceListFor(const std::string& text, const std::string& source,
                                            int rankEntry);

}  // namespace

std::vector<c10::Device> parseDeviceList(const std::string& text, const std::string& source) {
  return parseDeviceListFor(text, source, -1);
}

namespace {

std::vector<c10::Device> parseDeviceListFor(const std::string& text, const std::string& source,
                                            int rankEntry) {
  std::vector<c10::Device> devices;
  c10::DeviceIndex nextCuda = 0;
  const auto parts = splitOn(text, ',');
  HDDP_CHECK_AS(ConfigError, !parts.empty(), source,
                " is empty; give one device per local rank, e.g. cuda:0,cpu");
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts.size() > 1 && rankEntry >= 0 && static_cast<int>(i) != rankEntry &&
        namesEmu(parts[i]) && !c10::is_privateuse1_backend_registered()) {
      const std::string t = lower(trimmed(parts[i]));
      devices.push_back(t == "emu"
                            ? c10::Device(c10::DeviceType::PrivateUse1)
                            : c10::Device(c10::DeviceType::PrivateUse1,
                                          static_cast<c10::DeviceIndex>(std::stoi(t.substr(4)))));
      continue;
    }
    c10::Device d = parseDeviceName(parts[i], c10::str(source, " entry ", i, " of '", text, "'"));
    if (d.is_cuda() && !d.has_index()) {
      d = c10::Device(c10::kCUDA, nextCuda);
    }
    if (d.is_cuda()) {
      nextCuda = static_cast<c10::DeviceIndex>(d.index() + 1);
    }
    devices.push_back(d);
  }
  return devices;
}

}  // namespace

c10::Device chooseDevice(const LaunchInfo& info, int cudaDeviceCount, bool allowShared) {
  if (cudaDeviceCount <= 0) {
    return c10::Device(c10::kCPU);
  }
  const int index = info.slot >= 0 ? info.slot : info.localRank;
  const std::string who =
      info.slot >= 0 ? c10::str("slot ", index) : c10::str("local rank ", index);
  if (index >= cudaDeviceCount) {
    HDDP_CHECK_AS(ConfigError, allowShared, who, " needs cuda:", index, " but only ",
                  cudaDeviceCount, " CUDA device(s) are visible. Start at most ", cudaDeviceCount,
                  " ranks per node (--nproc-per-node), give each rank its device "
                  "(hddp-run --devices cuda:0,cpu or HDDP_DEVICE), check "
                  "CUDA_VISIBLE_DEVICES, or set HDDP_ALLOW_SHARED_DEVICE=1 to share devices "
                  "over Gloo (testing only)");
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index % cudaDeviceCount));
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

c10::Device resolveDevice(const LaunchInfo& info, const std::optional<c10::Device>& explicitDevice,
                          const EnvMap& env, int cudaDeviceCount, bool allowShared) {
  if (explicitDevice) {
    c10::Device d = *explicitDevice;
    if (d.is_cuda() && !d.has_index()) {
      d = bareCuda(info, cudaDeviceCount, allowShared);
    }
    checkPresent(d, info, "--device (InitOptions::device)", cudaDeviceCount);
    return d;
  }
  const auto it = env.find("HDDP_DEVICE");
  if (it == env.end() || trimmed(it->second).empty()) {
    return chooseDevice(info, cudaDeviceCount, allowShared);
  }
  const std::vector<c10::Device> list =
      parseDeviceListFor(it->second, "HDDP_DEVICE", info.localRank);
  c10::Device d = list.front();
  std::string source = "HDDP_DEVICE=" + it->second;
  if (list.size() > 1) {
    HDDP_CHECK_AS(ConfigError, static_cast<int>(list.size()) == info.localWorldSize,
                  "HDDP_DEVICE='", it->second, "' lists ", list.size(),
                  " devices but this node runs ", info.localWorldSize,
                  " local rank(s): give one device per local rank (hddp-run --devices), or "
                  "one device for all");
    d = list[static_cast<size_t>(info.localRank)];
    source = c10::str("entry ", info.localRank, " of HDDP_DEVICE='", it->second, "'");
  } else if (lower(trimmed(it->second)) == "cuda") {
    d = bareCuda(info, cudaDeviceCount, allowShared);  // one bare "cuda" for every rank
  }
  checkPresent(d, info, source, cudaDeviceCount);
  return d;
}

namespace {

c10::Device bareCuda(const LaunchInfo& info, int cudaDeviceCount, bool allowShared) {
  return cudaDeviceCount > 0 ? chooseDevice(info, cudaDeviceCount, allowShared)
                             : c10::Device(c10::kCUDA, 0);
}

}  // namespace

void checkDistinctDevices(const std::vector<std::string>& claims) {
  std::map<std::string, size_t> firstClaim;
  for (size_t r = 0; r < claims.size(); ++r) {
    const auto bar = claims[r].find('|');
    const std::string device = bar == std::string::npos ? claims[r] : claims[r].substr(bar + 1);
    if (device.rfind("cuda", 0) != 0) {
      continue;  // CPU ranks may share the host
    }
    auto inserted = firstClaim.emplace(claims[r], r);
    HDDP_CHECK_AS(ConfigError, inserted.second, "duplicate GPU detected: ranks ",
                  inserted.first->second, " and ", r, " both use ", device, " on host '",
                  claims[r].substr(0, bar),
                  "'. Each rank needs its own device: check LOCAL_RANK, --devices / "
                  "HDDP_DEVICE and CUDA_VISIBLE_DEVICES, or set HDDP_ALLOW_SHARED_DEVICE=1 "
                  "(hddp-run --share-devices) with the Gloo backend to share one GPU for "
                  "testing");
  }
}

std::string RankDeviceClaim::encode() const {
  std::string why = error;
  std::replace(why.begin(), why.end(), '|', '/');
  std::replace(why.begin(), why.end(), '\n', ' ');
  return c10::str(host, "|", device, "|", ncclAvailable ? 1 : 0, "|", requested, "|", requestedFrom,
                  "|", allowShared ? 1 : 0, "|", why);
}

RankDeviceClaim RankDeviceClaim::decode(const std::string& text) {
  const auto f = splitOn(text, '|');
  HDDP_CHECK_AS(DistributedError, f.size() == 7, "malformed device claim '", text,
                "' in the store: are all ranks running the same hddp version?");
  RankDeviceClaim c;
  c.host = f[0];
  c.device = f[1];
  c.ncclAvailable = f[2] == "1";
  c.requested = f[3];
  c.requestedFrom = f[4];
  c.allowShared = f[5] == "1";
  c.error = f[6];
  return c;
}

BackendAgreement agreeOnBackend(const std::vector<RankDeviceClaim>& claims) {
  HDDP_INTERNAL_ASSERT(!claims.empty(), "agreeOnBackend without claims");
  for (size_t r = 0; r < claims.size(); ++r) {
    HDDP_CHECK_AS(ConfigError, claims[r].error.empty(), "rank ", r,
                  " cannot join the job: ", claims[r].error);
  }
  auto asked = [](const RankDeviceClaim& c) {
    return c.requested +
           (c.requestedFrom.empty() ? " (the default)" : " (" + c.requestedFrom + ")");
  };
  for (size_t r = 1; r < claims.size(); ++r) {
    HDDP_CHECK_AS(ConfigError, claims[r].requested == claims[0].requested,
                  "the ranks ask for different backends: rank 0 for ", asked(claims[0]), ", rank ",
                  r, " for ", asked(claims[r]),
                  ". Set HDDP_BACKEND to the same value on every rank, or unset it everywhere "
                  "to let the ranks agree (NCCL when every rank is on CUDA, else Gloo)");
  }
  const bool allowShared = std::all_of(claims.begin(), claims.end(),
                                       [](const RankDeviceClaim& c) { return c.allowShared; });
  std::vector<std::string> hostDevices;
  for (const auto& c : claims) {
    hostDevices.push_back(c.host + "|" + c.device);
  }
  if (!allowShared) {
    checkDistinctDevices(hostDevices);
  }
  // Why NCCL cannot serve the job, or empty when it can.
  std::string noNccl;
  for (size_t r = 0; r < claims.size() && noNccl.empty(); ++r) {
    if (claims[r].device.rfind("cuda", 0) != 0) {
      noNccl = c10::str("rank ", r, " is on ", claims[r].device);
    } else if (!claims[r].ncclAvailable) {
      noNccl = c10::str("rank ", r, "'s LibTorch has no NCCL");
    }
  }
  std::map<std::string, size_t> first;
  for (size_t r = 0; r < claims.size() && noNccl.empty(); ++r) {
    auto inserted = first.emplace(hostDevices[r], r);
    if (!inserted.second) {
      noNccl = c10::str("ranks ", inserted.first->second, " and ", r, " share ", claims[r].device,
                        " on host '", claims[r].host, "'");
    }
  }
  const std::string& requested = claims[0].requested;
  if (requested == "nccl") {
    HDDP_CHECK_AS(ConfigError, noNccl.empty(), "backend nccl (", claims[0].requestedFrom,
                  ") cannot serve this job: ", noNccl,
                  ", and NCCL needs every rank on its own CUDA device. Use HDDP_BACKEND=gloo, "
                  "or unset it to let the ranks agree (Gloo stages CUDA tensors through host "
                  "memory)");
    return {Backend::Nccl, c10::str("asked for by ", claims[0].requestedFrom, " on every rank")};
  }
  if (requested == "gloo") {
    return {Backend::Gloo, c10::str("asked for by ", claims[0].requestedFrom, " on every rank")};
  }
  HDDP_CHECK_AS(ConfigError, requested == "auto", "unknown backend '", requested, "' asked for by ",
                claims[0].requestedFrom, "; use auto, gloo or nccl");
  if (noNccl.empty()) {
    return {Backend::Nccl, "every rank is on its own CUDA device"};
  }
  const bool anyCuda = std::any_of(claims.begin(), claims.end(), [](const RankDeviceClaim& c) {
    return c.device.rfind("cuda", 0) == 0;
  });
  if (!anyCuda) {
    return {Backend::Gloo,
            claims.size() == 1 ? "the rank is on the CPU" : "every rank is on the CPU"};
  }
  return {Backend::Gloo, noNccl +
                             ", so NCCL cannot serve the job; CUDA tensors go through pinned "
                             "host memory"};
}

}  // namespace hddp
