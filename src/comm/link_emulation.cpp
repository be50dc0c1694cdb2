// A communicator over an emulated slow link (hddp/comm/link_emulation.h): each
// collective's Work gets the time the emulated ring would end it; Work honours it.
#include "hddp/comm/link_emulation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>

#include "comm/work_impl.h"
#include "hddp/core/error.h"

namespace hddp {

double emulatedCollectiveSeconds(CollectiveKind kind, double bytes, int ranks,
                                 const LinkEmulation& link) {
  if (ranks <= 1 || !link.active()) {
    return 0.0;
  }
  const double n = ranks;
  const double perByte = link.bytesPerSecond > 0 ? 1.0 / link.bytesPerSecond : 0.0;
  const double L = link.latencySeconds;
  switch (kind) {
    case CollectiveKind::Allreduce:
      return 2.0 * (n - 1.0) / n * bytes * perByte + 2.0 * (n - 1.0) * L;
    case CollectiveKind::Allgather:
      return (n - 1.0) * bytes * perByte + (n - 1.0) * L;
    case CollectiveKind::ReduceScatter:
      return (n - 1.0) / n * bytes * perByte + (n - 1.0) * L;
    case CollectiveKind::Broadcast:
    case CollectiveKind::Reduce:
      return bytes * perByte + (n - 1.0) * L;
    case CollectiveKind::Barrier:
      return 2.0 * (n - 1.0) * L;
  }
  return 0.0;
}

namespace {

using Clock = std::chrono::steady_clock;

double bytesOf(const at::Tensor& t) { return static_cast<double>(t.numel() * t.element_size()); }

class LinkEmulatingCommunicator final : public Communicator {
 public:
  LinkEmulatingCommunicator(Communicator& inner, LinkEmulation link) : inner_(inner), link_(link) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Backend backend() const override { return inner_.backend(); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }
  c10::Device device() const override { return inner_.device(); }

  Work allreduce(at::Tensor& tensor, const AllreduceOptions& options) override {
    const double bytes = bytesOf(tensor);
    return delayed(inner_.allreduce(tensor, options), CollectiveKind::Allreduce, bytes);
  }
  Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                          const AllreduceOptions& options) override {
    double bytes = 0;
    for (const auto& t : tensors) {
      bytes += bytesOf(t);
    }
    return delayed(inner_.allreduceCoalesced(tensors, options), CollectiveKind::Allreduce, bytes);
  }
  using Communicator::allreduce;
  using Communicator::broadcast;
  using Communicator::reduceScatter;
  Work broadcast(at::Tensor& tensor, const BroadcastOptions& options) override {
    const double bytes = bytesOf(tensor);
    return delayed(inner_.broadcast(tensor, options), CollectiveKind::Broadcast, bytes);
  }
  Work reduce(at::Tensor& tensor, const ReduceOptions& options) override {
    const double bytes = bytesOf(tensor);
    return delayed(inner_.reduce(tensor, options), CollectiveKind::Reduce, bytes);
  }
  Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                 const AllgatherOptions& options) override {
    return delayed(inner_.allgather(outputs, input, options), CollectiveKind::Allgather,
                   bytesOf(input));
  }
  Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                     const ReduceScatterOptions& options) override {
    return delayed(inner_.reduceScatter(output, input, options), CollectiveKind::ReduceScatter,
                   bytesOf(input));
  }
  Work barrier(const BarrierOptions& options) override {
    return delayed(inner_.barrier(options), CollectiveKind::Barrier, 0.0);
  }
  void synchronize() override { inner_.synchronize(); }
  RemovableHandle addWaitObserver(WaitObserver& observer) override {
    return inner_.addWaitObserver(observer);
  }

 private:
  // The collective occupies the link from when it is issued (or the link frees up)
  // for its ring time; its Work completes no sooner.
  Work delayed(Work work, CollectiveKind kind, double bytes) {
    const double seconds = emulatedCollectiveSeconds(kind, bytes, inner_.size(), link_);
    if (seconds <= 0) {
      return work;
    }
    Clock::time_point end;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const Clock::time_point start = std::max(Clock::now(), linkFreeAt_);
      end = start +
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
      linkFreeAt_ = end;
    }
    WorkAccess::impl(work)->notBefore = end;
    return work;
  }

  Communicator& inner_;
  LinkEmulation link_;
  std::mutex mutex_;
  Clock::time_point linkFreeAt_{};
};

}  // namespace

std::unique_ptr<Communicator> emulateLink(Communicator& inner, LinkEmulation link) {
  HDDP_CHECK_AS(ConfigError, std::isfinite(link.bytesPerSecond) && link.bytesPerSecond >= 0,
                "emulated link: the bandwidth must be a finite number >= 0 bytes/s, got ",
                link.bytesPerSecond);
  HDDP_CHECK_AS(ConfigError, std::isfinite(link.latencySeconds) && link.latencySeconds >= 0,
                "emulated link: the latency must be a finite number >= 0 s, got ",
                link.latencySeconds);
  return std::make_unique<LinkEmulatingCommunicator>(inner, link);
}

}  // namespace hddp
