// Typed exchanges over a communicator: fixed-size values every rank contributes, for the
// bookkeeping collectives (the planner's estimates, a seed cost, an out-of-memory report)
// that would otherwise pack bytes by hand.
//
// agreeAll / agreeAny turn a rank's own answer (a path compared with another, a cache
// that may be filled on some ranks only, a local file, a clock) into the same answer on
// every rank: every branch that adds, skips or reorders a collective is decided through
// them or another exchange, never from per-rank state (docs/architecture.md, "Agreed
// decisions").
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
#include <exception>
#include <string>
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

/// True on every rank when `mine` is true on every rank (a logical AND over the ranks).
/// Collective and blocking; every rank calls it at the same point.
inline bool agreeAll(Communicator& comm, bool mine) {
  for (const uint8_t said : allgatherValue<uint8_t>(comm, mine ? 1 : 0)) {
    if (said == 0) {
      return false;
    }
  }
  return true;
}

/// True on every rank when `mine` is true on some rank (a logical OR over the ranks).
/// Collective and blocking; every rank calls it at the same point.
inline bool agreeAny(Communicator& comm, bool mine) { return !agreeAll(comm, !mine); }

/// Runs `work` on this rank, then tells every rank how it went (one allgather after
/// `work`, on every rank): where `work` threw here, its exception is rethrown; where it
/// threw on another rank only, an `E` naming `what`, the lowest such rank and its message
/// is thrown. So a failure one rank meets alone (a file it cannot read, a full disk) ends
/// the call on every rank together, instead of leaving the others in the next collective
/// until its timeout. `work` must run no collective itself (a rank that threw would skip
/// it).
template <typename E = Error, typename Work>
void agreeOutcome(Communicator& comm, const std::string& what, Work&& work) {
  std::exception_ptr error;
  std::string message;
  try {
    work();
  } catch (const c10::Error& e) {
    error = std::current_exception();
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = std::current_exception();
    message = e.what();
  }
  // Nothing for success; a failure's message, never empty.
  std::vector<uint8_t> said(message.begin(), message.end());
  if (error && said.empty()) {
    said.push_back('?');
  }
  const auto all = comm.allgatherBytes(said);
  if (error) {
    std::rethrow_exception(error);
  }
  for (size_t r = 0; r < all.size(); ++r) {
    HDDP_CHECK_AS(E, all[r].empty(), what, " failed on rank ", r, ": ",
                  std::string(all[r].begin(), all[r].end()));
  }
}

}  // namespace hddp
