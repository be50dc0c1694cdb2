#include "ddp/coalesced.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <map>

namespace hddp {
namespace detail {

void broadcastCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, int root,
                        int64_t chunkBytes) {
  c10::NoGradGuard noGrad;
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
    }
  }
  for (auto& entry : groups) {
    auto& group = entry.second;
    size_t first = 0;
    while (first < group.size()) {
      size_t end = first;
      int64_t bytes = 0;
      std::vector<at::Tensor> flat;
      while (end < group.size() &&
             (end == first || bytes + static_cast<int64_t>(group[end].nbytes()) <= chunkBytes)) {
        bytes += static_cast<int64_t>(group[end].nbytes());
        flat.push_back(group[end].detach().reshape({-1}));
        ++end;
      }
      at::Tensor buffer = at::cat(flat);
      comm.broadcast(buffer, root).wait();
      int64_t offset = 0;
      for (size_t i = first; i < end; ++i) {
        at::Tensor& t = group[i];
        t.detach().copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
      first = end;
    }
  }
}

void averageCoalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, double weight) {
  c10::NoGradGuard noGrad;
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[t.device().str()].push_back(t);
    }
  }
  bool noWeight = false;
  for (auto& entry : groups) {
    auto& group = entry.second;
    // Ordered by dtype, so that each dtype's buffers are joined and converted once (a
    // few kernels per step, not a few per buffer).
    std::stable_sort(group.begin(), group.end(), [](const at::Tensor& a, const at::Tensor& b) {
      return static_cast<int>(a.scalar_type()) < static_cast<int>(b.scalar_type());
    });
    int64_t elements = 0;
    std::vector<at::Tensor> flat;
    for (size_t i = 0; i < group.size();) {
      size_t j = i;
      std::vector<at::Tensor> same;
      while (j < group.size() && group[j].scalar_type() == group[i].scalar_type()) {
        same.push_back(group[j].detach().reshape({-1}));
        elements += group[j].numel();
        ++j;
      }
      if (weight > 0) {
        flat.push_back(at::cat(same).to(at::kDouble).mul_(weight));
      }
      i = j;
    }
    const auto doubles = group.front().options().dtype(at::kDouble);
    if (!(weight > 0)) {
      // A rank with weight 0 sends zeros, not 0 x its values: an inf or NaN that a rank
      // without samples holds must not reach the others.
      flat.push_back(at::zeros({elements}, doubles));
    }
    flat.push_back(at::full({1}, weight, doubles));
    at::Tensor buffer = at::cat(flat);
    comm.allreduce(buffer).wait();
    comm.synchronize();  // the total weight is read on the host next
    const int64_t n = buffer.numel();
    const double total = buffer[n - 1].item<double>();  // the same on every rank
    if (!(total > 0)) {
      noWeight = true;
      continue;
    }
    at::Tensor mean = buffer.narrow(0, 0, n - 1).div(total);
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
  if (noWeight) {
    broadcastCoalesced(comm, tensors, 0);  // no rank had samples: rank 0's values
  }
}

}  // namespace detail
}  // namespace hddp
