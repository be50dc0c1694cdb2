#include "hddp/core/step_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <optional>
#include <string>

#include "hddp/core/error.h"

namespace hddp {
namespace {

using Clock = std::chrono::steady_clock;

class HostStepTimer final : public StepTimer {
 public:
  void start(const StepLabel& label) override {
    open_ = true;
    label_ = label;
    start_ = Clock::now();
    queuedAtStart_ = threadQueuedSeconds();
    wait_ = 0.0;
    depth_ = 0;
    waited_ = false;
  }
  // Nested spans (a caller's own span around a Work::wait() that an observer marks too)
  // count once: the outermost.
  void beginWait() override {
    if (open_ && depth_++ == 0) {
      waitStart_ = Clock::now();
    }
  }
  void endWait() override {
    if (open_ && depth_ > 0 && --depth_ == 0) {
      lastWaitEnd_ = Clock::now();
      waited_ = true;
      wait_ += std::chrono::duration<double>(lastWaitEnd_ - waitStart_).count();
    }
  }
  void stop() override {
    if (!open_) {
      return;
    }
    if (depth_ > 0) {
      depth_ = 1;
      endWait();
    }
    open_ = false;
    const auto now = Clock::now();
    StepTiming t;
    t.label = label_;
    t.totalSeconds = std::chrono::duration<double>(now - start_).count();
    t.waitSeconds = wait_;
    t.tailSeconds = waited_ ? std::chrono::duration<double>(now - lastWaitEnd_).count() : 0.0;
    const double queued = threadQueuedSeconds();
    if (queued >= 0 && queuedAtStart_ >= 0) {
      t.queuedSeconds = std::min(std::max(0.0, queued - queuedAtStart_), t.computeSeconds());
    }
    done_.push_back(t);
  }
  std::vector<StepTiming> collect() override {
    std::vector<StepTiming> out(done_.begin(), done_.end());
    done_.clear();
    return out;
  }
  const char* describe() const override { return "host clock"; }

 private:
  bool open_ = false;
  int depth_ = 0;  // open wait spans
  bool waited_ = false;
  StepLabel label_;
  Clock::time_point start_;
  Clock::time_point waitStart_;
  Clock::time_point lastWaitEnd_;
  double queuedAtStart_ = -1.0;
  double wait_ = 0.0;
  std::deque<StepTiming> done_;
};

// One step's events: start, the wait spans' ends, stop. Events are reused across
// steps (a pool), since creating one per mark would cost a driver call each.
class DeviceStepTimer final : public StepTimer {
 public:
  explicit DeviceStepTimer(const c10::Device& device)
      : device_(device), guard_(device.type()), name_(device.str() + " events") {
    HDDP_CHECK_AS(ConfigError, !device.is_cpu(),
                  "a device step timer needs a device with events, not the CPU");
  }

  void start(const StepLabel& label) override {
    if (open_) {
      release(*open_);  // abandoned: never stopped
    }
    open_ = Marks{label, take(), {}, {}, nullptr, nullptr, nullptr};
    depth_ = 0;
    record(*open_->start);
  }
  void beginWait() override {
    if (open_ && depth_++ == 0) {
      open_->waits.push_back(take());
      record(*open_->waits.back());
    }
  }
  void endWait() override {
    if (open_ && depth_ > 0 && --depth_ == 0) {
      open_->waitEnds.push_back(take());
      record(*open_->waitEnds.back());
    }
  }
  void copySpan(std::shared_ptr<c10::Event> start, std::shared_ptr<c10::Event> end) override {
    if (open_ && start && end) {
      open_->copyStart = std::move(start);
      open_->copyEnd = std::move(end);
    }
  }
  void stop() override {
    if (!open_) {
      return;
    }
    if (depth_ > 0) {
      depth_ = 1;
      endWait();
    }
    open_->stop = take();
    record(*open_->stop);
    pending_.push_back(std::move(*open_));
    open_.reset();
  }
  std::vector<StepTiming> collect() override {
    std::vector<StepTiming> out;
    // Events complete in stream order: the first incomplete stop ends the harvest.
    while (!pending_.empty() && pending_.front().stop->query()) {
      Marks& m = pending_.front();
      StepTiming t;
      t.label = m.label;
      t.totalSeconds = m.start->elapsedTime(*m.stop) / 1e3;
      for (size_t i = 0; i < m.waitEnds.size(); ++i) {
        t.waitSeconds += m.waits[i]->elapsedTime(*m.waitEnds[i]) / 1e3;
      }
      if (!m.waitEnds.empty()) {
        t.tailSeconds = m.waitEnds.back()->elapsedTime(*m.stop) / 1e3;
      }
      // The compute stream waited for the copy before the step's first event, so the
      // copy is complete when the step's stop is.
      if (m.copyStart && m.copyEnd && m.copyEnd->query()) {
        t.transferSeconds = m.copyStart->elapsedTime(*m.copyEnd) / 1e3;
      }
      out.push_back(t);
      release(m);
      pending_.pop_front();
    }
    return out;
  }
  const char* describe() const override { return name_.c_str(); }

 private:
  using EventPtr = std::unique_ptr<c10::Event>;
  struct Marks {
    StepLabel label;
    EventPtr start;
    std::vector<EventPtr> waits;
    std::vector<EventPtr> waitEnds;
    EventPtr stop;
    std::shared_ptr<c10::Event> copyStart;  // the loader's, on its copy stream
    std::shared_ptr<c10::Event> copyEnd;
  };

  EventPtr take() {
    if (free_.empty()) {
      return std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    }
    EventPtr e = std::move(free_.back());
    free_.pop_back();
    return e;
  }
  void release(Marks& m) {
    auto give = [&](EventPtr& e) {
      if (e) {
        free_.push_back(std::move(e));
      }
    };
    give(m.start);
    give(m.stop);
    m.copyStart.reset();
    m.copyEnd.reset();
    for (auto& e : m.waits) give(e);
    for (auto& e : m.waitEnds) give(e);
  }
  void record(c10::Event& event) { event.record(guard_.getStream(device_)); }

  c10::Device device_;
  c10::impl::VirtualGuardImpl guard_;
  std::string name_;
  std::optional<Marks> open_;
  int depth_ = 0;  // open wait spans; nested ones count once
  std::deque<Marks> pending_;
  std::vector<EventPtr> free_;
};

}  // namespace

double threadQueuedSeconds() {
  // "time on the cpu, time waiting on a runqueue, timeslices", in nanoseconds.
  std::FILE* f = std::fopen("/proc/thread-self/schedstat", "r");
  if (f == nullptr) {
    return -1.0;
  }
  unsigned long long running = 0;
  unsigned long long waiting = 0;
  const int n = std::fscanf(f, "%llu %llu", &running, &waiting);
  std::fclose(f);
  return n == 2 ? static_cast<double>(waiting) / 1e9 : -1.0;
}

std::unique_ptr<StepTimer> makeHostStepTimer() { return std::make_unique<HostStepTimer>(); }

std::unique_ptr<StepTimer> makeDeviceStepTimer(const c10::Device& device) {
  return std::make_unique<DeviceStepTimer>(device);
}

std::unique_ptr<StepTimer> makeStepTimer(const c10::Device& device) {
  if (device.is_cpu()) {
    return makeHostStepTimer();
  }
  return makeDeviceStepTimer(device);
}

}  // namespace hddp
