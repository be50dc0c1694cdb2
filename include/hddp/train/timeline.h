// A Chrome-trace / Perfetto timeline of every rank's step phases on one time axis (like
// Horovod's timeline): open the file in https://ui.perfetto.dev or chrome://tracing.
// One process row per rank; track 0 holds the training thread's phases (data wait,
// forward, backward, optimizer step, save), track 1 each gradient bucket's allreduce.
// Time zero is the end of a barrier all ranks pass together at the start. Disabled,
// add() is one branch; enabled, an event costs a vector append.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace hddp {

class Communicator;

/// A timeline row of a rank.
enum class Track : int {
  /// The training thread's phases.
  Training = 0,
  /// Each gradient bucket's allreduce and other collectives.
  Communication = 1,
};

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  explicit Timeline(bool enabled = false) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  /// Time zero (call right after a barrier, on every rank).
  void setOrigin(Clock::time_point origin) { origin_ = origin; }
  /// A phase [begin, end) of `step` on `track`, with an optional `value` (samples,
  /// bytes; -1 = none). `name` must be a string literal (it is kept as a pointer).
  void add(const char* name, Clock::time_point begin, Clock::time_point end, int64_t step,
           Track track = Track::Training, int64_t value = -1) {
    if (enabled_) {
      events_.push_back(Event{name, begin, end, step, track, value});
    }
  }
  size_t size() const { return events_.size(); }
  /// This rank's events as Chrome trace JSON objects (a comma-separated list).
  std::string serialize(int rank) const;
  /// Gathers every rank's events to rank 0, which writes `path` (a JSON trace).
  /// Collective: every rank calls it.
  void write(Communicator& communicator, const std::string& path) const;

 private:
  struct Event {
    const char* name;
    Clock::time_point begin;
    Clock::time_point end;
    int64_t step;
    Track track;
    int64_t value;
  };
  bool enabled_;
  Clock::time_point origin_ = Clock::now();
  std::vector<Event> events_;
};

}  // namespace hddp
