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

void averageCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, double weight) {
  c10::NoGradGuard noGrad;
  // Rank 0 adds 2^-40 to its weight: where every rank has weight 0 the mean is rank 0's
  // values exactly (x * 2^-40 / 2^-40 is exact in float64), otherwise it shifts the
  // mean by about 1e-12 of it, below float32's resolution. No branch on a value read
  // back from the device.
  const double kTieBreak = 1.0 / static_cast<double>(int64_t{1} << 40);
  const double w = weight + (comm.rank() == 0 ? kTieBreak : 0.0);
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[t.device().str()].push_back(t);
    }
  }
  for (auto& entry : groups) {
    auto& group = entry.second;
    std::vector<at::Tensor> flat;
    for (const auto& t : group) {
      flat.push_back(t.detach().reshape({-1}).to(at::kDouble).mul(w));
    }
    flat.push_back(at::full({1}, w, group.front().options().dtype(at::kDouble)));
    at::Tensor buffer = at::cat(flat);
    comm.allreduce(buffer).wait();
    const int64_t n = buffer.numel();
    at::Tensor mean = buffer.narrow(0, 0, n - 1).div(buffer.narrow(0, n - 1, 1));
    int64_t offset = 0;
    for (auto& t : group) {
      at::Tensor part = mean.narrow(0, offset, t.numel()).view(t.sizes());
      if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
        part = part.round();
      }
      t.detach().copy_(part);
      offset += t.numel();
    }
  }
}

}  // namespace detail
}  // namespace hddp
