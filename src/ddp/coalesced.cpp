#include "ddp/coalesced.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>

namespace hddp {
namespace detail {

void broadcastCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, int root) {
  c10::NoGradGuard noGrad;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
    }
  }
  for (auto& entry : groups) {
    auto& group = entry.second;
    std::vector<at::Tensor> flat;
    for (const auto& t : group) {
      flat.push_back(t.detach().reshape({-1}));
    }
    at::Tensor buffer = at::cat(flat);
    comm.broadcast(buffer, root).wait();
    int64_t offset = 0;
    for (auto& t : group) {
      t.detach().copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace detail
}  // namespace hddp
