#include "ddp/bucketing.h"

#include <map>
#include <sstream>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"

namespace hddp {
namespace ddp {

std::vector<std::vector<int>> assignBuckets(const std::vector<at::Tensor>& params,
                                            const std::vector<int>& order, int64_t firstCap,
                                            int64_t cap) {
  struct Open {
    int bucket = -1;
    int64_t bytes = 0;
    int filled = 0;  // buckets closed so far for this dtype/device
  };
  std::map<std::pair<int, std::string>, Open> open;
  std::vector<std::vector<int>> assignment;
  for (int index : order) {
    const at::Tensor& t = params[static_cast<size_t>(index)];
    Open& o = open[std::make_pair(static_cast<int>(t.scalar_type()), t.device().str())];
    const int64_t limit = o.filled == 0 ? firstCap : cap;
    if (o.bucket < 0) {
      o.bucket = static_cast<int>(assignment.size());
      assignment.emplace_back();
    }
    assignment[static_cast<size_t>(o.bucket)].push_back(index);
    o.bytes += t.numel() * static_cast<int64_t>(t.element_size());
    if (o.bytes >= limit) {
      o.bucket = -1;
      o.bytes = 0;
      ++o.filled;
    }
  }
  return assignment;
}

void checkOneDevice(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  if (named.empty()) {
    return;
  }
  const auto& [firstName, first] = named.front();
  for (const auto& [name, t] : named) {
    HDDP_CHECK_AS(ConfigError, t.device() == first.device(), "DistributedDataParallel wraps ",
                  "a module on one device, but parameter '", firstName, "' is on ", first.device(),
                  " and '", name, "' on ", t.device(),
                  ". Move the whole module with module->to(device) (one device per rank; "
                  "a model split over devices is not supported)");
  }
}

void checkModelsAgree(Communicator& comm,
                      const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  if (comm.size() == 1) {
    return;
  }
  std::ostringstream sig;
  for (const auto& [name, t] : entries) {
    sig << name << ' ' << t.scalar_type() << ' ' << t.sizes() << '\n';
  }
  const std::string mine = sig.str();
  auto all = comm.allgatherBytes(std::vector<uint8_t>(mine.begin(), mine.end()));
  const std::string reference(all[0].begin(), all[0].end());
  for (int r = 1; r < comm.size(); ++r) {
    const std::string other(all[static_cast<size_t>(r)].begin(), all[static_cast<size_t>(r)].end());
    if (other == reference) {
      continue;
    }
    std::istringstream a(reference);
    std::istringstream b(other);
    std::string la;
    std::string lb;
    int line = 0;
    while (true) {
      const bool ga = static_cast<bool>(std::getline(a, la));
      const bool gb = static_cast<bool>(std::getline(b, lb));
      if (!ga || !gb || la != lb) {
        HDDP_THROW(ConfigError, "the model differs between rank 0 and rank ", r, " at entry ", line,
                   ": rank 0 has '", ga ? la : std::string("nothing more"), "', rank ", r, " has '",
                   gb ? lb : std::string("nothing more"),
                   "'. Every rank must build the same model (same layers, shapes, dtypes and "
                   "requires_grad flags) before wrapping it.");
      }
      ++line;
    }
  }
}

}  // namespace ddp
}  // namespace hddp
