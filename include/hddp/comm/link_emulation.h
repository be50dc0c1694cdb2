// An emulated slow link under a communicator's collectives, for tests, benchmarks and
// demos only: every collective takes at least the time a ring over the job's slowest
// link would (a laptop GPU beside a Thunderbolt eGPU whose gradients cross 2.8 GB/s).
// Off unless asked for (the Trainer turns it on from EmulationOptions, i.e.
// --emulate-link-gbps / HDDP_EMULATE_LINK_GBPS; announced in the log).
//
// The link is one resource: collectives issued back to back share it, so the second
// ends a ring's time after the first. A collective's Work completes (wait() returns,
// isCompleted() turns true, onCompletion callbacks run) at the later of the real
// completion and the emulated one. Over a ring of n ranks whose slowest link carries B
// bytes/s with a latency L per message, for S bytes:
//   allreduce       2(n-1)/n x S / B + 2(n-1) L        (S: the tensor; reduce-scatter + allgather)
//   allgather       (n-1) x S / B + (n-1) L            (S: one rank's input)
//   reduceScatter   (n-1)/n x S / B + (n-1) L          (S: the whole input)
//   broadcast       S / B + (n-1) L                    (a pipelined chain)
//   reduce          S / B + (n-1) L                    (a pipelined chain, towards the root)
//   barrier         2(n-1) L
// One rank alone sends nothing and waits for nothing.
#pragma once

#include <cstdint>
#include <memory>

#include "hddp/comm/communicator.h"

namespace hddp {

struct LinkEmulation {
  /// The slowest link's bandwidth in bytes/s (every rank of the job uses the same
  /// value); 0 = off.
  double bytesPerSecond = 0.0;
  /// Latency per message, seconds. Default 0.
  double latencySeconds = 0.0;
  bool active() const { return bytesPerSecond > 0 || latencySeconds > 0; }
};

enum class CollectiveKind { Allreduce, Allgather, ReduceScatter, Broadcast, Reduce, Barrier };

/// The emulated seconds of one collective of `bytes` (see the table above) on `ranks`
/// ranks; 0 for one rank or an inactive link.
double emulatedCollectiveSeconds(CollectiveKind kind, double bytes, int ranks,
                                 const LinkEmulation& link);

/// A communicator whose collectives go through `inner` and complete no sooner than the
/// emulated link allows. `inner` must outlive it. ConfigError for a negative or
/// non-finite bandwidth or latency. Wait observers added to it are added to `inner`.
std::unique_ptr<Communicator> emulateLink(Communicator& inner, LinkEmulation link);

}  // namespace hddp
