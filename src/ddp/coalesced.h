// Coalesced broadcast: one collective per dtype/device instead of one per tensor.
#pragma once

#include <cstdint>
#include <vector>

#include "hddp/comm/communicator.h"

namespace hddp {
namespace detail {

/// Broadcasts `tensors` from `root` in place, grouped by dtype and device, each group
/// through flat buffers of at most `chunkBytes` (a tensor larger than that alone), so
/// the copy it needs stays that size (PyTorch DDP's construction broadcast: 250 MiB
/// buckets). Blocks until done.
void broadcastCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, int root,
                        int64_t chunkBytes = int64_t{250} << 20);

/// Sets every tensor to the weighted mean over ranks, sum_r w_r x_r / sum_r w_r, with
/// `weight` this rank's w_r (its samples since the last synchronisation): the ranks
/// that computed the values set them, and a rank with weight 0 (no samples) sets
/// nothing (it sends zeros, so an inf it holds reaches nobody). Where every rank has
/// weight 0, rank 0's values win, as a broadcast. The mean is taken in float64; integer
/// and bool tensors are rounded to the nearest. One allreduce per device (and a
/// broadcast where no rank had weight); blocks until done, reading the total weight on
/// the host. The tensors must be on one device
/// per group, the communicator's or one it can stage.
void averageCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, double weight);

}  // namespace detail
}  // namespace hddp
