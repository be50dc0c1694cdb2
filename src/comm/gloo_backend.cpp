// Gloo through LibTorch's own c10d::ProcessGroupGloo (see third_party/gloo_decls).
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/backends.h"
#include "hddp/core/env.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace detail {

c10::intrusive_ptr<c10d::Backend> createGlooBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const CommunicatorOptions& options) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  const auto iface = env::resolveString("HDDP_GLOO_INTERFACE",
                                        options.glooInterface.empty()
                                            ? std::nullopt
                                            : std::optional<std::string>(options.glooInterface));
  if (!iface.value.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface.value));
  } else if (!options.glooHostname.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.glooHostname));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  const auto threads = env::resolveInt(
      "HDDP_GLOO_THREADS",
      options.glooThreads > 0 ? std::optional<int64_t>(options.glooThreads) : std::nullopt);
  opts->threads = static_cast<int>(std::max<int64_t>(1, threads.value));
  HDDP_LOG_DEBUG("comm", "creating Gloo communicator: rank ", rank, "/", size, ", ", opts->threads,
                 " threads, interface '", iface.value, "', address '", options.glooHostname, "'");
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

}  // namespace detail
}  // namespace hddp
