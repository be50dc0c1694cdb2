// Time that passes only when a test says so, for Trainer tests whose plans must not
// depend on the machine's speed (DESIGN.md: no test needs a speed). Each rank has its
// own VirtualClock; the test's model advances it by a known time per sample (in forward,
// and in backward through a gradient hook), and everything the planner learns reads it:
// the step timer (VirtualClockTimer), the seed's timed forward and an emulated slower
// card's marks and sleeps (TrainerOptions::measurementClock). The planner then learns
// exactly the costs the test set, on a loaded machine as on an idle one, and its plans
// can be compared with the solver's split of those costs for equality.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "hddp/core/step_timer.h"
#include "hddp/train/trainer.h"

namespace hddp {
namespace testing {

// Seconds on one rank's virtual clock, kept in whole nanoseconds (advanced from the
// rank's thread and from autograd's; read from both).
class VirtualClock {
 public:
  double now() const { return static_cast<double>(nanoseconds_.load()) * 1e-9; }
  void advance(double seconds) { nanoseconds_ += std::llround(seconds * 1e9); }

 private:
  std::atomic<int64_t> nanoseconds_{0};
};

// The host timer's bookkeeping on a VirtualClock: a step's total is the clock's advance
// from start() to stop(), its waits the advance inside the outermost wait spans, its
// tail the advance from the last wait's end to stop(). With `copyBytesPerSecond` > 0
// each step also carries the transfer its input bytes take over a link of that speed, as
// a device timer's copy events would (0: none, as on a CPU rank).
class VirtualClockTimer final : public hddp::StepTimer {
 public:
  VirtualClockTimer(std::shared_ptr<VirtualClock> clock, double copyBytesPerSecond)
      : clock_(std::move(clock)), copyBytesPerSecond_(copyBytesPerSecond) {}
  void start(const hddp::StepLabel& label) override {
    open_ = true;
    hadWait_ = false;
    depth_ = 0;
    current_ = {};
    current_.label = label;
    start_ = clock_->now();
  }
  void beginWait() override {
    if (open_ && depth_++ == 0) {
      waitStart_ = clock_->now();
    }
  }
  void endWait() override {
    if (open_ && depth_ > 0 && --depth_ == 0) {
      current_.waitSeconds += clock_->now() - waitStart_;
      lastWaitEnd_ = clock_->now();
      hadWait_ = true;
    }
  }
  void stop() override {
    if (!open_) {
      return;
    }
    const double end = clock_->now();
    current_.totalSeconds = end - start_;
    current_.tailSeconds = hadWait_ ? end - lastWaitEnd_ : 0.0;
    if (copyBytesPerSecond_ > 0) {
      current_.transferSeconds = static_cast<double>(current_.label.bytes) / copyBytesPerSecond_;
    }
    done_.push_back(current_);
    open_ = false;
    hadWait_ = false;
  }
  std::vector<hddp::StepTiming> collect() override { return std::exchange(done_, {}); }
  const char* describe() const override { return "a virtual clock (test)"; }

 private:
  std::shared_ptr<VirtualClock> clock_;
  double copyBytesPerSecond_;
  bool open_ = false;
  bool hadWait_ = false;
  int depth_ = 0;
  double start_ = 0.0;
  double waitStart_ = 0.0;
  double lastWaitEnd_ = 0.0;
  hddp::StepTiming current_;
  std::vector<hddp::StepTiming> done_;
};

// Puts every time `options`' Trainer learns from on `clock`: its step timer (with the
// copy times of a link of `copyBytesPerSecond`, 0 = none), its seed's timed forward, and
// its emulator, whose sleeps advance the clock instead of the machine's time.
inline void measureOn(const std::shared_ptr<VirtualClock>& clock, hddp::TrainerOptions& options,
                      double copyBytesPerSecond = 0.0) {
  options.stepTimer = [clock, copyBytesPerSecond](const c10::Device&) {
    return std::make_unique<VirtualClockTimer>(clock, copyBytesPerSecond);
  };
  options.measurementClock.now = [clock] { return clock->now(); };
  options.measurementClock.sleep = [clock](std::chrono::duration<double> d) {
    clock->advance(d.count());
  };
}

// Advances `clock` by `seconds` when autograd passes back through `t`, as a backward of
// that cost would (a forward's output with no gradient is left alone); returns `t`.
inline at::Tensor costsInBackward(const at::Tensor& t, std::shared_ptr<VirtualClock> clock,
                                  double seconds) {
  if (t.requires_grad()) {
    t.register_hook([clock = std::move(clock), seconds](const at::Tensor& grad) {
      clock->advance(seconds);
      return grad;
    });
  }
  return t;
}

}  // namespace testing
}  // namespace hddp
