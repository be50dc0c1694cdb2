// How long a training step computed, as opposed to how long it waited for the other
// ranks.
//
// A step is bracketed by start() and stop(); between them, beginWait()/endWait() mark
// each span in which the rank waits for communication: every Work::wait() of a
// communicator that the timer observes (the Trainer registers it with
// Communicator::addWaitObserver: DDP's buckets, SyncBatchNorm's statistics in forward
// and backward, a user's own collectives), and the read of the step's status. Spans
// may nest; the outermost counts. The compute time is the step's length minus those spans.
//
// The host timer reads the host clock at each mark: right for backends whose waits
// block the host (Gloo). On a device, NCCL's Work::wait() only makes the stream wait
// and the host runs ahead, so host time would count the wait for a slower rank as
// compute (at the next synchronization); the device timer records an event on the
// device's current stream at each mark instead, and reads the events once they have
// completed, usually one step later, so timing adds no synchronization to the step.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace c10 {
struct Event;
}

namespace hddp {

/// What a step was (given to start(), handed back with its timing).
struct StepLabel {
  int64_t step = 0;
  int64_t samples = 0;
  /// Input bytes the step moved to its device (for an emulated link).
  int64_t bytes = 0;
};

struct StepTiming {
  StepLabel label;
  /// start() to stop().
  double totalSeconds = 0.0;
  /// Sum of the beginWait() .. endWait() spans.
  double waitSeconds = 0.0;
  /// From the end of the last wait to stop(): in a training step the optimizer step,
  /// whose cost does not grow with the batch. 0 when the step had no wait.
  double tailSeconds = 0.0;
  /// The input's copy to the device, timed by events on the loader's copy stream
  /// (copySpan()); 0 when not measured (CPU ranks, no copy events given).
  double transferSeconds = 0.0;
  /// Of the step, the time the timing thread was ready to run but had no core (Linux
  /// schedstat: other processes on the same cores); 0 when unknown or on a device.
  double queuedSeconds = 0.0;
  double computeSeconds() const {
    return totalSeconds > waitSeconds ? totalSeconds - waitSeconds : 0.0;
  }
};

class StepTimer {
 public:
  virtual ~StepTimer() = default;
  /// Opens a step; a step still open (abandoned before stop()) is dropped.
  virtual void start(const StepLabel& label) = 0;
  virtual void beginWait() = 0;
  virtual void endWait() = 0;
  /// The open step's input copy: events recorded on the copy stream before and after
  /// it (timing enabled). The device timer reads their interval with the step's other
  /// events; the host timer has no use for them.
  virtual void copySpan(std::shared_ptr<c10::Event> /*start*/,
                        std::shared_ptr<c10::Event> /*end*/) {}
  /// Closes the step opened by start().
  virtual void stop() = 0;
  /// The timings of closed steps whose measurements are complete, oldest first, each
  /// once. Never blocks: the host timer returns the step just stopped, the device timer
  /// the steps whose events the device has passed (typically up to the previous one).
  virtual std::vector<StepTiming> collect() = 0;
  /// What it measures, for the log: "host clock", "cuda:0 events".
  virtual const char* describe() const = 0;
};

/// Host clock at each mark (CPU ranks, Gloo); also the calling thread's time in the
/// run queue over the step (start() and stop() from the same thread).
std::unique_ptr<StepTimer> makeHostStepTimer();
/// Events on `device`'s current stream at each mark (timing events, c10::Event with
/// EventFlag::BACKEND_DEFAULT). Throws hddp::ConfigError for a CPU device.
std::unique_ptr<StepTimer> makeDeviceStepTimer(const c10::Device& device);
/// The host timer for a CPU device, the device timer otherwise.
std::unique_ptr<StepTimer> makeStepTimer(const c10::Device& device);

/// Seconds the calling thread has spent ready to run without a core since it started
/// (/proc/thread-self/schedstat); a negative value where the kernel does not say.
double threadQueuedSeconds();

}  // namespace hddp
