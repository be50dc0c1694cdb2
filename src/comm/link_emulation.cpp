// A communicator over an emulated slow link (hddp/comm/link_emulation.h): each
// collective's Work gets the time the emulated ring would end it; Work honours it. On a
// device the ring starts when the collective's input exists there (an event recorded at
// issue), not when the host issued it.
#include "hddp/comm/link_emulation.h"

#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>

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

Clock::duration durationOf(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// An event on the current stream of `input`'s device, recorded as the collective is
// issued: it completes when the device has computed the input. Null for a CPU tensor
// (ready when issued) or a device without events.
std::unique_ptr<c10::Event> inputReadyEvent(const at::Tensor* input) {
  if (input == nullptr || !input->defined() || input->device().is_cpu()) {
    return nullptr;
  }
  try {
    const c10::Device device = input->device();
    const c10::impl::VirtualGuardImpl guard(device.type());
    auto event = std::make_unique<c10::Event>(device.type());
    event->record(guard.getStream(device));
    return event;
  } catch (const c10::Error&) {
    return nullptr;  // no events on this device: timed from the issue, as on the host
  }
}

// One collective's passage over the link, when it has to wait for its input on a device
// or for such a passage before it: its end is known once the link has seen the input
// ready. Its future completes at the end, once the real collective has completed.
class Passage {
 public:
  Passage(std::unique_ptr<c10::Event> inputReady, double seconds)
      : inputReady_(std::move(inputReady)), issued_(Clock::now()), length_(durationOf(seconds)) {}

  // Whether the input is on the device (the link's thread asks; null event: at issue).
  bool inputIsReady() const { return !inputReady_ || inputReady_->query(); }
  Clock::time_point issued() const { return issued_; }
  Clock::duration length() const { return length_; }

  void resolve(Clock::time_point end) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      end_ = end;
      resolved_ = true;
    }
    resolvedCv_.notify_all();
  }
  // Whether the emulated end has passed by `now` (never blocks).
  bool passedAt(Clock::time_point now) {
    std::lock_guard<std::mutex> lock(mutex_);
    return resolved_ && now >= end_;
  }
  bool passed() { return passedAt(Clock::now()); }
  Clock::time_point endAt() {
    std::lock_guard<std::mutex> lock(mutex_);
    return end_;
  }
  // Blocks until the emulated end; TimeoutError when the input was not ready on its
  // device within `timeout`.
  void await(std::chrono::milliseconds timeout) {
    Clock::time_point end;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!resolvedCv_.wait_for(lock, timeout, [this] { return resolved_; })) {
        HDDP_THROW(TimeoutError, "emulated link: the collective's input was not ready on its ",
                   "device within ", timeout.count(), " ms");
      }
      end = end_;
    }
    std::this_thread::sleep_until(end);
  }

  // The future handed out for completion callbacks (created on first use).
  c10::intrusive_ptr<c10::ivalue::Future> future() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!future_) {
        future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      }
    }
    settle();
    return future_;
  }
  // The real collective completed (`error` set when it failed) / the emulated end passed.
  void innerCompleted(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      innerDone_ = true;
      innerError_ = std::move(error);
    }
    settle();
  }
  void due() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      due_ = true;
    }
    settle();
  }

 private:
  // Completes the future when both have happened (outside the lock: its callbacks run).
  void settle() {
    c10::intrusive_ptr<c10::ivalue::Future> fire;
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (future_ && innerDone_ && due_ && !completed_) {
        completed_ = true;
        fire = future_;
        error = innerError_;
      }
    }
    if (!fire) {
      return;
    }
    if (error) {
      fire->setError(error);
    } else {
      fire->markCompleted(c10::IValue(c10::List<at::Tensor>()));
    }
  }

  std::unique_ptr<c10::Event> inputReady_;
  Clock::time_point issued_;
  Clock::duration length_;
  std::mutex mutex_;
  std::condition_variable resolvedCv_;
  bool resolved_ = false;
  Clock::time_point end_{};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool innerDone_ = false;
  bool due_ = false;
  bool completed_ = false;
  std::exception_ptr innerError_;
};

// The real collective's work, completed no sooner than its passage over the link.
class LinkWork final : public c10d::Work {
 public:
  LinkWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<Passage> passage,
           std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), passage_(std::move(passage)), timeout_(timeout) {}

  bool isCompleted() override { return (!inner_ || inner_->isCompleted()) && passage_->passed(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (inner_) {
      inner_->wait(timeout);
    }
    passage_->await(timeout.count() > 0 ? timeout : timeout_);
    return true;
  }
  void synchronize() override {
    if (inner_) {
      inner_->synchronize();
    }
    passage_->await(timeout_);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (!watching_) {
      watching_ = true;
      if (inner_) {
        std::weak_ptr<Passage> passage = passage_;
        inner_->getFuture()->addCallback([passage](c10::ivalue::Future& f) {
          if (auto p = passage.lock()) {
            p->innerCompleted(f.hasError() ? f.exception_ptr() : nullptr);
          }
        });
      } else {
        passage_->innerCompleted(nullptr);
      }
    }
    return passage_->future();
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<Passage> passage_;
  std::chrono::milliseconds timeout_;
  bool watching_ = false;
};

// The link: one resource that collectives cross in the order they were issued. A
// collective starts when its input is ready (on a device: when the event recorded at
// issue has completed, not when the host issued it, which may be long before the
// device computed the gradient) and the link is free. Passages that wait for a device
// are resolved by a thread of the link's own, which polls their events in order and
// completes their futures at their ends.
class Link {
 public:
  ~Link() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  // The end of a collective ready at issue when nothing waits before it; nullopt: it has
  // to queue (it was enqueued as `passage`, created by `make`).
  template <typename Make>
  std::optional<Clock::time_point> enter(bool onDevice, double seconds, Make make,
                                         std::shared_ptr<Passage>& passage) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!onDevice && queue_.empty()) {
      const Clock::time_point end = std::max(Clock::now(), freeAt_) + durationOf(seconds);
      freeAt_ = end;
      return end;
    }
    passage = make();
    queue_.push_back(passage);
    if (!thread_.joinable()) {
      thread_ = std::thread([this] { run(); });
    }
    wake_.notify_all();
    return std::nullopt;
  }

 private:
  static constexpr std::chrono::microseconds kPoll{200};

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      Clock::time_point now = Clock::now();
      while (!queue_.empty() && (stop_ || inputIsReady(*queue_.front()))) {
        std::shared_ptr<Passage> p = std::move(queue_.front());
        queue_.pop_front();
        now = Clock::now();
        const Clock::time_point end = std::max({now, p->issued(), freeAt_}) + p->length();
        freeAt_ = end;
        p->resolve(end);
        due_.push_back(std::move(p));
      }
      while (!due_.empty() && (stop_ || due_.front()->passedAt(now))) {
        std::shared_ptr<Passage> p = std::move(due_.front());
        due_.pop_front();
        lock.unlock();
        p->due();  // runs completion callbacks
        lock.lock();
        now = Clock::now();
      }
      if (stop_ && queue_.empty() && due_.empty()) {
        return;
      }
      Clock::time_point until = Clock::time_point::max();
      if (!due_.empty()) {
        until = due_.front()->endAt();
      }
      if (!queue_.empty()) {
        until = std::min(until, now + kPoll);
      }
      if (until == Clock::time_point::max()) {
        wake_.wait(lock);
      } else {
        wake_.wait_until(lock, until);
      }
    }
  }

  // A failing query (a broken device) counts as ready: the real collective reports it.
  static bool inputIsReady(const Passage& p) {
    try {
      return p.inputIsReady();
    } catch (const c10::Error&) {
      return true;
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Passage>> queue_;  // waiting for their input, in issue order
  std::deque<std::shared_ptr<Passage>> due_;    // resolved, ends not yet passed (in order)
  Clock::time_point freeAt_{};
  bool stop_ = false;
  std::thread thread_;
};

class LinkEmulatingCommunicator final : public Communicator {
 public:
  LinkEmulatingCommunicator(Communicator& inner, LinkEmulation link) : inner_(inner), link_(link) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Backend backend() const override { return inner_.backend(); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }
  c10::Device device() const override { return inner_.device(); }

  Work allreduce(at::Tensor& tensor, const AllreduceOptions& options) override {
    return delayed(CollectiveKind::Allreduce, bytesOf(tensor), &tensor,
                   [&] { return inner_.allreduce(tensor, options); });
  }
  Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                          const AllreduceOptions& options) override {
    double bytes = 0;
    for (const auto& t : tensors) {
      bytes += bytesOf(t);
    }
    return delayed(CollectiveKind::Allreduce, bytes, tensors.empty() ? nullptr : &tensors[0],
                   [&] { return inner_.allreduceCoalesced(tensors, options); });
  }
  using Communicator::allreduce;
  using Communicator::broadcast;
  using Communicator::reduceScatter;
  Work broadcast(at::Tensor& tensor, const BroadcastOptions& options) override {
    return delayed(CollectiveKind::Broadcast, bytesOf(tensor), &tensor,
                   [&] { return inner_.broadcast(tensor, options); });
  }
  Work reduce(at::Tensor& tensor, const ReduceOptions& options) override {
    return delayed(CollectiveKind::Reduce, bytesOf(tensor), &tensor,
                   [&] { return inner_.reduce(tensor, options); });
  }
  Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                 const AllgatherOptions& options) override {
    return delayed(CollectiveKind::Allgather, bytesOf(input), &input,
                   [&] { return inner_.allgather(outputs, input, options); });
  }
  Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                     const ReduceScatterOptions& options) override {
    return delayed(CollectiveKind::ReduceScatter, bytesOf(input), &input,
                   [&] { return inner_.reduceScatter(output, input, options); });
  }
  Work barrier(const BarrierOptions& options) override {
    return delayed(CollectiveKind::Barrier, 0.0, nullptr, [&] { return inner_.barrier(options); });
  }
  void synchronize() override { inner_.synchronize(); }
  RemovableHandle addWaitObserver(WaitObserver& observer) override {
    return inner_.addWaitObserver(observer);
  }

 private:
  // The collective occupies the link from when its input is ready (on a device: an
  // event recorded before it is issued) and the link is free, for its ring time; its
  // Work completes no sooner.
  template <typename Issue>
  Work delayed(CollectiveKind kind, double bytes, const at::Tensor* input, Issue issue) {
    const double seconds = emulatedCollectiveSeconds(kind, bytes, inner_.size(), link_);
    if (seconds <= 0) {
      return issue();
    }
    std::unique_ptr<c10::Event> ready = inputReadyEvent(input);
    const bool onDevice = ready != nullptr;
    std::shared_ptr<Passage> passage;
    const auto end = emulated_.enter(
        onDevice, seconds, [&] { return std::make_shared<Passage>(std::move(ready), seconds); },
        passage);
    Work work = issue();
    WorkAccess::Impl* impl = WorkAccess::impl(work);
    if (end) {
      impl->notBefore = *end;  // ready at issue, nothing queued before it
    } else {
      impl->work = c10::make_intrusive<LinkWork>(std::move(impl->work), std::move(passage),
                                                 inner_.timeout());
    }
    return work;
  }

  Communicator& inner_;
  LinkEmulation link_;
  Link emulated_;
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
