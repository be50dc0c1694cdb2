#pragma once

// Private to hddp::emu: how side streams run. Each side stream has its own worker thread
// that runs the stream's queued tasks in order; a Marker is the point an event recorded.

#include <c10/core/Stream.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace hddp {
namespace emu {
namespace detail {

/// Side streams per device in the global pool (ids 1..kPoolSize); getNewStream() hands out
/// ids above it.
constexpr c10::StreamId kPoolSize = 4;

/// The queue and thread of one side stream. Owned by the process-wide registry (worker());
/// never destroyed. Thread safety: every method may be called from any thread.
class StreamWorker {
 public:
  explicit StreamWorker(c10::Stream stream);
  StreamWorker(const StreamWorker&) = delete;
  StreamWorker& operator=(const StreamWorker&) = delete;

  /// Queues `task`; it runs after every task queued before it, after the stream delay.
  void enqueue(std::function<void()> task);
  /// Blocks until every task queued so far has run.
  void drain();
  /// Whether every task queued so far has run (never blocks).
  bool idle();

 private:
  void run();

  c10::Stream stream_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  std::thread thread_;
};

/// The worker of side stream `stream` (id != 0), created on first use.
StreamWorker& worker(c10::Stream stream);
/// Drains every side stream of `device` that has a worker.
void drainDevice(c10::DeviceIndex device);
/// A fresh stream id for getNewStream().
c10::StreamId newStreamId();

/// The point in a stream an event recorded: done once the stream reached it.
struct Marker {
  std::atomic<bool> done{false};
  std::chrono::steady_clock::time_point when;
};
void completeMarker(Marker& marker);
void waitMarker(const Marker& marker);

}  // namespace detail
}  // namespace emu
}  // namespace hddp
