// Heterogeneity emulation, for tests, benchmarks and demos only: makes a rank behave
// like a slower card or one behind a slower link by stretching its measured compute
// time by a factor and adding transfer time for the bytes it actually moved (it sleeps
// the difference). Off unless asked for; announced in the log when on.
//
//   HDDP_EMULATE_SLOWDOWN=1:3        rank 1 computes 3x slower ("2.0" alone: every rank)
//   HDDP_EMULATE_LINK_GBPS=1:2.8     rank 1's input link carries 2.8 GB/s
//   HDDP_EMULATE_MEMORY_CAP=1:40     rank 1 runs out of memory (c10::OutOfMemoryError)
//                                    when given more than 40 samples in a step
//   HDDP_EMULATE_MEMORY=1:200+12/1000
//                                    rank 1's memory reads 200 MiB + 12 MiB per sample
//                                    of a 1000 MiB device (what the Trainer measures and
//                                    derives caps from), and it runs out of memory when
//                                    a step needs more than the device has
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "hddp/balance/estimator.h"
#include "hddp/core/step_timer.h"

namespace hddp {

struct EmulationOptions {
  /// Compute time multiplier (>= 1). Default 1 (off).
  double slowdown = 1.0;
  /// Emulated link bandwidth in bytes/s for this rank's input copies; 0 = off.
  double linkBytesPerSecond = 0.0;
  /// The job's slowest emulated link in bytes/s, which every collective crosses (a ring
  /// is as fast as its slowest link): the Trainer's collectives take the time the ring
  /// would (hddp/comm/link_emulation.h). 0 = off. emulationFromEnv and the trainers'
  /// --emulate-link-gbps set it from the whole per-rank list: the same on every rank.
  double collectiveBytesPerSecond = 0.0;
  /// Latency per message of the emulated link, seconds (HDDP_EMULATE_LINK_LATENCY_US,
  /// --emulate-link-latency-us); with it, collectives are emulated even at full
  /// bandwidth. Default 0.
  double linkLatencySeconds = 0.0;
  /// Largest local batch that "fits"; a larger one throws c10::OutOfMemoryError in the
  /// forward pass, as a card out of memory does. 0 = off.
  int64_t memoryCapSamples = 0;
  /// Emulated device memory: the rank's memory reads fixed + perSample x b bytes in a
  /// step of b samples, of a device of memoryTotalBytes; a step that needs more
  /// throws c10::OutOfMemoryError. memoryTotalBytes 0 = off.
  double memoryFixedBytes = 0.0;
  double memoryPerSampleBytes = 0.0;
  double memoryTotalBytes = 0.0;
  bool emulatesMemory() const { return memoryTotalBytes > 0; }
  bool active() const {
    return slowdown != 1.0 || linkBytesPerSecond > 0 || collectiveBytesPerSecond > 0 ||
           linkLatencySeconds > 0 || memoryCapSamples > 0 || emulatesMemory();
  }
  /// ConfigError naming `rank` for a slowdown below 1, above 1e6 or not finite (inf
  /// would sleep forever), a negative or infinite bandwidth, a negative cap.
  void validate(int rank) const;
};

/// This rank's emulation from HDDP_EMULATE_SLOWDOWN / _LINK_GBPS / _MEMORY_CAP in a job
/// of `worldSize` ranks; throws hddp::ConfigError on malformed values, naming the
/// variable (every item is checked, not only this rank's).
EmulationOptions emulationFromEnv(int rank, int worldSize);

/// Whom the items of a per-rank list name. In an elastic job (hddp-run
/// --nproc-per-node MIN:MAX, which sets HDDP_SLOTS and HDDP_SLOT_COUNT) an item names a
/// slot, the identity that stays when the group re-forms (rank numbers move when a lower
/// slot leaves); otherwise it names a rank.
struct ListMembers {
  /// Per rank, its slot; empty: items name ranks.
  std::vector<int> slotOfRank;
  /// Slots of the job (its MAX ranks).
  int slotCount = 0;
  bool bySlot() const { return !slotOfRank.empty(); }
};
/// From HDDP_SLOTS (the generation's slots in rank order, "0,2") and HDDP_SLOT_COUNT;
/// ranks when they are not set. ConfigError when they do not describe `worldSize` ranks.
ListMembers listMembersFromEnv(int worldSize);

/// Parses a per-rank list, "1:3,2:1.5" (listed ranks) or "2.0" (every rank), for a job of
/// `worldSize` ranks: one value per rank, `fallback` where not listed. ConfigError naming
/// `variable` for an item that is not rank:value, a rank outside 0..worldSize-1, a rank
/// listed twice, or a value that is not a finite number. In an elastic job the items
/// name slots (listMembersFromEnv): a slot outside the job is an error, a slot of the
/// job that is not in this generation is ignored (logged once).
std::vector<double> parseRankValues(const std::string& variable, const std::string& text,
                                    int worldSize, double fallback);

/// One rank's emulated memory from HDDP_EMULATE_MEMORY's syntax, per rank
/// "rank:FIXED+PER_SAMPLE/TOTAL" in MiB, items separated by commas ("1:200+12/1000").
/// Sets the three memory fields of `options` when `rank` is listed; ConfigError naming
/// `variable` for a malformed item, a rank outside the job, a negative size, or a total
/// that does not hold the fixed part.
void parseEmulatedMemory(const std::string& variable, const std::string& text, int worldSize,
                         int rank, EmulationOptions& options);
/// The slowest of a per-rank list of link bandwidths in GB/s (parseRankValues with
/// fallback 0: 0 = the rank has no emulated link), in bytes/s; 0 when none is emulated.
double slowestEmulatedLink(const std::vector<double>& gbpsPerRank);

/// parseRankValues for memory caps: a listed cap is a whole number of samples >= 1
/// (0 is an error, not "no cap"); an unlisted rank gets 0 = no cap.
std::vector<int64_t> parseRankCaps(const std::string& variable, const std::string& text,
                                   int worldSize);

/// Sleeps what an emulated rank would take longer than this one.
///
/// A slowed-down rank's extra compute is spread over the step as a slower card spends it:
/// the Trainer marks the step's start (beginStep), the end of forward (endForward) and,
/// through DdpOptions::beforeBucketLaunch, the moment each gradient bucket is about to
/// be sent (beforeBucketLaunch); each mark sleeps (slowdown - 1) x the compute since the
/// previous one. So a bucket leaves when the slower card would have computed its
/// gradients, and its allreduce overlaps the rest of the stretched backward as on real
/// hardware (sleeping all of it after the step made the buckets leave early and together
/// and overstated the exposed communication wait). measure() then sleeps what remains
/// of the step's extra time (the part after the last bucket, the optimizer step, the
/// emulated link): the marks' sleeps lie inside the step timer's span and count there as
/// compute, so measure() takes them out before stretching; the planner learns
/// slowdown x the real compute, the same sum as without marks. Without beginStep (a
/// hand-written loop that calls measure() or apply() only) the whole extra time is
/// slept after the step.
///
/// Thread safety: one step at a time. The bucket marks run on the autograd engine's
/// thread while the training thread waits in backward; nothing else may call it
/// concurrently. Movable, not shared.
class Emulator {
 public:
  using Sleep = std::function<void(std::chrono::duration<double>)>;
  /// What the marks read: `now`, seconds on a steady clock; `queued`, the calling
  /// thread's seconds spent ready to run with no core free (threadQueuedSeconds();
  /// negative: unknown), which is not stretched. Empty: the real ones; tests pass their own.
  struct Clocks {
    std::function<double()> now;
    std::function<double()> queued;
  };
  /// `sleep` defaults to std::this_thread::sleep_for; tests pass their own.
  explicit Emulator(EmulationOptions options, int rank = 0, Sleep sleep = {}, Clocks clocks = {});

  bool active() const { return options_.active(); }
  /// After a step that computed for `computeSeconds` and moved `bytesMoved` input
  /// bytes: sleeps the emulated extra time and returns the emulated compute seconds.
  /// `queuedSeconds` of the compute were spent ready to run with no core free (ranks
  /// sharing a machine's cores, StepTiming::queuedSeconds): they are not stretched, as
  /// a slower card would not wait for the host's cores any longer, and stretching them
  /// made a slow rank's emulated time grow with the load of the ranks beside it.
  double apply(double computeSeconds, int64_t bytesMoved, double queuedSeconds = 0.0);

  /// A step's timing as the planner should learn it: on the emulated card and link when
  /// emulation is on (its extra time slept first, by apply(), so that the other ranks
  /// wait for this one as for a slower card behind a slower link), else as measured.
  struct Measured {
    StepMeasurement measurement;  // for BatchPlanner::record
    /// The step's compute as reported (metrics): the emulated link's time included.
    double computeSeconds = 0;
    /// The emulated extra time slept (0: none).
    double emulatedSeconds = 0;
  };
  /// Takes out the time the marks slept in the step (it lies in the step timer's span)
  /// and sleeps only the remainder of the step's extra time.
  Measured measure(const StepTiming& timing);

  /// Step `step` (the StepLabel the step timer is given) starts now with `samples` local
  /// samples; opens the marks below when the rank is slowed down and has samples. A
  /// step begun again (a repeat after an out-of-memory abandon) starts afresh.
  void beginStep(int64_t step, int64_t samples);
  /// Forward ended: sleeps (slowdown - 1) x forward's compute (nothing overlaps it).
  void endForward();
  /// DDP's bucket `bucket` is about to be sent (DdpOptions::beforeBucketLaunch): sleeps
  /// (slowdown - 1) x the compute since the previous mark.
  void beforeBucketLaunch(int bucket);
  /// Seconds the marks have slept in step `step` so far (0 for a step not begun).
  double sleptInStep(int64_t step) const;
  /// `seconds` of compute as the emulated card takes them (no sleep).
  double stretch(double seconds) const { return seconds * options_.slowdown; }
  /// Seconds `bytes` of input take over the emulated link (0 without one).
  double transferSeconds(int64_t bytes) const {
    return options_.linkBytesPerSecond > 0
               ? static_cast<double>(bytes) / options_.linkBytesPerSecond
               : 0.0;
  }
  /// Throws c10::OutOfMemoryError when `samples` exceed the emulated memory cap, or
  /// need more than the emulated device memory.
  void checkMemory(int64_t samples) const;
  const EmulationOptions& options() const { return options_; }

 private:
  double stretchStep(double computeSeconds, int64_t bytesMoved, double queuedSeconds,
                     double alreadySlept);
  double stretchSinceMark();
  void mark();

  EmulationOptions options_;
  Sleep sleep_;
  Clocks clocks_;
  // The open step's marks (beginStep .. measure() of that step or the next beginStep).
  bool open_ = false;
  int64_t openStep_ = 0;
  double lastMark_ = 0.0;
  double lastQueued_ = -1.0;
  std::thread::id lastThread_;
  // Per step, what its marks slept, until measure() takes it (a device timer hands a
  // step's timing over one step late).
  std::map<int64_t, double> slept_;
};

}  // namespace hddp
