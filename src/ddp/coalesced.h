// Coalesced broadcast: one collective per dtype/device instead of one per tensor.
#pragma once

#include <vector>

#include "hddp/comm/communicator.h"

namespace hddp {
namespace detail {

/// Broadcasts `tensors` from `root` in place, grouped by dtype and device, each group
/// through one flat buffer. Blocks until done.
void broadcastCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, int root);

}  // namespace detail
}  // namespace hddp
