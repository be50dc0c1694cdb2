// Typed exchanges over a communicator: fixed-size values every rank contributes, for the
// bookkeeping collectives (the planner's estimates, a seed cost, an out-of-memory report)
// that would otherwise pack bytes by hand.
//
// allgatherValue<T>(comm, mine) returns every rank's T, by rank. T must be trivially
// copyable (plain structs and arrays of numbers: its bytes travel as they are, padding
// included, so give T no padding; every rank must run the same build, as for any
// collective). Blocking; a collective: every rank
// calls it in the same order. Throws hddp::Error naming the rank when a rank sent a value
// of another size (a rank of another build).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"

namespace hddp {

template <typename T>
std::vector<T> allgatherValue(Communicator& comm, const T& mine) {
  static_assert(std::is_trivially_copyable<T>::value,
                "allgatherValue sends a value's bytes: T must be trivially copyable");
  std::vector<uint8_t> bytes(sizeof(T));
  std::memcpy(bytes.data(), &mine, sizeof(T));
  const auto all = comm.allgatherBytes(bytes);
  std::vector<T> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    HDDP_CHECK(all[r].size() == sizeof(T), "allgatherValue: rank ", r, " sent ", all[r].size(),
               " bytes where ", sizeof(T),
               " were expected; every rank must run the same hddp build");
    std::memcpy(&out[r], all[r].data(), sizeof(T));
  }
  return out;
}

}  // namespace hddp
