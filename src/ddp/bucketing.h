// DDP's pure parts (private to the ddp layer): which parameters share a bucket, and the
// checks made when a module is wrapped.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace hddp {

class Communicator;

namespace ddp {

/// Groups parameter indices, taken in `order`, into buckets of one dtype and device:
/// a bucket closes once it holds at least `firstCap` bytes (the first bucket of its
/// dtype/device) or `cap` bytes (the others). Returns each bucket's indices in order.
std::vector<std::vector<int>> assignBuckets(const std::vector<at::Tensor>& params,
                                            const std::vector<int>& order, int64_t firstCap,
                                            int64_t cap);

/// ConfigError naming two tensors on different devices (one device per rank). Gradients
/// of parameters on different devices arrive on different autograd threads, which would
/// race on the step's state; PyTorch's DDP likewise wants one device per process.
void checkOneDevice(const std::vector<std::pair<std::string, at::Tensor>>& named);

/// ConfigError naming the first entry where a rank's model differs from rank 0's; each
/// entry is "kind name dtype shape" (collective).
void checkModelsAgree(Communicator& comm,
                      const std::vector<std::pair<std::string, at::Tensor>>& entries);

}  // namespace ddp
}  // namespace hddp
