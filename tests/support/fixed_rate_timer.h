// A step timer for tests that reports a fixed cost per sample and never a wait: the
// measurement a card of exactly that speed gives, whatever the machine running the test
// does, so that the planner's evidence (and its plan changes) are the same on any
// machine, loaded or not.
#pragma once

#include <utility>
#include <vector>

#include "hddp/core/step_timer.h"

namespace hddp {
namespace testing {

class FixedRateTimer : public StepTimer {
 public:
  explicit FixedRateTimer(double secondsPerSample) : secondsPerSample_(secondsPerSample) {}
  void start(const StepLabel& label) override {
    open_ = true;
    label_ = label;
  }
  void beginWait() override {}
  void endWait() override {}
  void stop() override {
    if (!open_) {
      return;
    }
    StepTiming t;
    t.label = label_;
    t.totalSeconds = secondsPerSample_ * static_cast<double>(label_.samples);
    done_.push_back(t);
    open_ = false;
  }
  std::vector<StepTiming> collect() override { return std::exchange(done_, {}); }
  const char* describe() const override { return "a fixed rate (test)"; }

 private:
  double secondsPerSample_;
  bool open_ = false;
  StepLabel label_;
  std::vector<StepTiming> done_;
};

}  // namespace testing
}  // namespace hddp
