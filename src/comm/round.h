// The generation's own keys under torchrun's agent store (internal to the comm layer).
#pragma once

#include <chrono>
#include <string>

namespace hddp {

class Store;

/// Agrees on a round id for the ranks of one generation on a store that outlives
/// generations (torchrun's agent store, kept through its rendezvous rounds). Rank 0
/// announces a fresh id at "hddp/round" and waits until the `worldSize - 1` other ranks
/// joined it; they join only an id not yet complete, so an id an earlier generation left
/// there is passed over. Returns the id, the same on every rank; DistributedError after
/// `timeout`.
std::string agreeOnRound(Store& store, int rank, int worldSize, std::chrono::milliseconds timeout);

}  // namespace hddp
