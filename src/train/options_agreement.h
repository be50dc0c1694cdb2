// The Trainer's options that shape the sequence of collectives, checked to be the same on
// every rank (internal to the train layer; docs/architecture.md, "Agreed decisions").
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace hddp {

class Communicator;
struct TrainerOptions;

namespace train {

/// The options that decide which collectives a rank runs, and when (the batch, the
/// steps, the stops, saves and loads given or not, ZeRO, the planner's exchanges, DDP's
/// buckets and hook), as (name, value) in a fixed order.
std::vector<std::pair<std::string, std::string>> collectiveShapingOptions(const TrainerOptions& o);

/// Compares collectiveShapingOptions() of every rank with rank 0's (collective: one
/// allgather). hddp::ConfigError on every rank naming the first option that differs and
/// the ranks' values: a rank given other flags would run other collectives than the rest
/// and leave them waiting until the timeout.
void checkOptionsAgree(Communicator& comm, const TrainerOptions& o);

}  // namespace train
}  // namespace hddp
