// Typed exchanges over a communicator: fixed-size values every rank contributes, for the
// bookkeeping collectives (the planner's estimates, a seed cost, an out-of-memory report)
// that would otherwise pack bytes by hand, and the one home of rank agreement: every
// branch that adds, skips or reorders a collective is decided through these, never from
// per-rank state (a path, a cache, a local file, a clock: docs/architecture.md, "Agreed
// decisions").
//
//   allgatherValue<T>     every rank's T, by rank
//   agreeAll / agreeAny   a rank's own yes/no made everyone's (AND / OR)
//   reduceValues          several numbers reduced (sum, max, min) in one allreduce
//   broadcastBytes        a root's bytes, of any length, to every rank
//   runAndShareOutcome    run on some ranks; every rank learns each rank's outcome or
//   runAndShareResult<T>  error (with a fixed-size record T), to decide or throw alike
//   agreeOutcome<E>       run on every rank; a failure anywhere throws everywhere
//
// Every function here is a collective: every rank calls it at the same point, in the same
// order as its other collectives, and it blocks until its result is on the host. The
// number of collectives each runs is documented and depends only on what every rank sees
// alike. Values travel as their bytes: T must be trivially copyable with no padding, and
// every rank must run the same hddp build (as for any collective).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"

namespace hddp {

/// Every rank's `mine`, by rank. One allgatherBytes (two collectives). Throws hddp::Error
/// naming the rank when a rank sent a value of another size (a rank of another build).
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
/// One allgather of a byte.
bool agreeAll(Communicator& comm, bool mine);

/// True on every rank when `mine` is true on some rank (a logical OR over the ranks).
bool agreeAny(Communicator& comm, bool mine);

/// `values` reduced element-wise over the ranks with `op` (Sum, Max, Min; Avg divides
/// the sum by the ranks), as float64: one allreduce of values.size() numbers on the
/// communicator's device, whatever their count. Every rank passes the same count (not
/// checked: a rank with another count leaves the others in the collective); an empty
/// list throws hddp::Error before any collective.
std::vector<double> reduceValues(Communicator& comm, const std::vector<double>& values,
                                 ReduceOp op = ReduceOp::Sum);

/// The same for a fixed count: `auto [sum, n] = reduceValues(comm, {loss, samples});`.
template <size_t N>
std::array<double, N> reduceValues(Communicator& comm, const std::array<double, N>& values,
                                   ReduceOp op = ReduceOp::Sum) {
  static_assert(N > 0, "reduceValues: at least one value");
  const auto reduced = reduceValues(comm, std::vector<double>(values.begin(), values.end()), op);
  std::array<double, N> out{};
  std::copy(reduced.begin(), reduced.end(), out.begin());
  return out;
}

/// `root`'s `payload` on every rank (the others' `payload` is ignored): its length, then
/// its bytes, on the communicator's device. Two broadcasts, the second also for an empty
/// payload. Returns the root's own payload on the root.
std::string broadcastBytes(Communicator& comm, int root, const std::string& payload);

/// What kind of failure a rank met, by the type of what it threw: the others rethrow a
/// failure of the same kind (throwAs) with the rank's message.
enum class FailureKind : uint8_t {
  None = 0,         // it succeeded, or did not run
  Error = 1,        // an hddp::Error of no kind below
  Config = 2,       // hddp::ConfigError
  Data = 3,         // hddp::DataError
  State = 4,        // hddp::StateError
  Distributed = 5,  // hddp::DistributedError (StoreError, TimeoutError, BackendError)
  OutOfMemory = 6,  // c10::OutOfMemoryError, std::bad_alloc, or LibTorch's CPU allocator's
                    // c10::Error ("DefaultCPUAllocator: can't allocate memory"): no input's fault
  Device = 7,       // c10::AcceleratorError (a device's failure)
  Foreign = 8,      // another c10::Error, std::exception or unknown exception
};

/// One rank's outcome: its failure (None when it succeeded) and its message (the
/// exception's, without backtrace; on success whatever the caller put there, usually
/// nothing).
struct RankOutcome {
  FailureKind failure = FailureKind::None;
  std::string message;
  bool failed() const { return failure != FailureKind::None; }
};

/// The same with a fixed-size record `T` (trivially copyable, no padding) that the rank's
/// work filled in: a count, a step, a rank number. Set also when the work failed after
/// setting it (a record is never text parsed back).
template <typename T>
struct RankResult : RankOutcome {
  T value{};
};

/// The exception being handled (call inside a catch block), as an outcome: its kind and
/// message.
RankOutcome currentFailure();

/// Inside a catch block: rethrows the exception being handled when it is running out of
/// memory (FailureKind::OutOfMemory), so that a handler turning what a reader refused
/// into "the file is damaged" leaves memory alone (a good file must not be discarded).
void rethrowIfOutOfMemory();

/// Throws an exception of `kind`'s type with `message` (HDDP_THROW's form; hddp::Error for
/// Error, OutOfMemory, Device and Foreign: another rank's failure is not this rank's out
/// of memory). Never returns; `kind` must not be None.
[[noreturn]] void throwAs(FailureKind kind, const std::string& message);

/// Every rank's outcome, by rank: one allgatherBytes, which is one collective when every
/// rank succeeded with an empty message and two otherwise. Bytes from other ranks are
/// checked (an unknown kind is an hddp::Error naming the rank).
std::vector<RankOutcome> allgatherOutcomes(Communicator& comm, const RankOutcome& mine);

/// The lowest rank whose outcome failed, or -1.
template <typename Outcome>
int firstFailed(const std::vector<Outcome>& all) {
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].failed()) {
      return static_cast<int>(r);
    }
  }
  return -1;
}

namespace detail {
std::vector<uint8_t> packResult(const RankOutcome& outcome, const void* value, size_t size);
/// Checks rank `rank`'s record, copies its value into `value` and returns its outcome.
RankOutcome unpackResult(const std::vector<uint8_t>& bytes, int rank, void* value, size_t size);
}  // namespace detail

/// Every rank's result, by rank: one allgatherBytes (two collectives), whatever the
/// outcomes.
template <typename T>
std::vector<RankResult<T>> allgatherResults(Communicator& comm, const RankResult<T>& mine) {
  static_assert(std::is_trivially_copyable<T>::value,
                "allgatherResults sends a record's bytes: T must be trivially copyable");
  const auto all = comm.allgatherBytes(detail::packResult(mine, &mine.value, sizeof(T)));
  std::vector<RankResult<T>> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    static_cast<RankOutcome&>(out[r]) =
        detail::unpackResult(all[r], static_cast<int>(r), &out[r].value, sizeof(T));
  }
  return out;
}

/// Runs `work()` where `runHere` is true, catches whatever it throws, then tells every rank
/// how each rank's part went (allgatherOutcomes: one collective when all succeeded, two
/// otherwise). Throws nothing of the work's: the caller decides, the same way on every
/// rank, from the outcomes. `work` must run no collective itself.
template <typename Work>
std::vector<RankOutcome> runAndShareOutcome(Communicator& comm, bool runHere, Work&& work) {
  RankOutcome mine;
  if (runHere) {
    try {
      work();
    } catch (...) {
      mine = currentFailure();
    }
  }
  return allgatherOutcomes(comm, mine);
}

/// The same where the work fills in a record: `work(T& value)`; every rank's value and
/// outcome, by rank (allgatherResults: two collectives).
template <typename T, typename Work>
std::vector<RankResult<T>> runAndShareResult(Communicator& comm, bool runHere, Work&& work) {
  RankResult<T> mine;
  if (runHere) {
    try {
      work(mine.value);
    } catch (...) {
      static_cast<RankOutcome&>(mine) = currentFailure();
    }
  }
  return allgatherResults(comm, mine);
}

/// Runs `work` on this rank, then tells every rank how it went (runAndShareOutcome: one
/// collective when every rank succeeded): where `work` threw here, its exception is
/// rethrown; where it threw on another rank only, an `E` naming `what`, the lowest such
/// rank and its message is thrown. So a failure one rank meets alone (a file it cannot
/// read, a full disk) ends the call on every rank together, instead of leaving the others
/// in the next collective until its timeout. `work` must run no collective itself.
template <typename E = Error, typename Work>
void agreeOutcome(Communicator& comm, const std::string& what, Work&& work) {
  std::exception_ptr error;
  RankOutcome mine;
  try {
    work();
  } catch (...) {
    error = std::current_exception();
    mine = currentFailure();
  }
  const auto all = allgatherOutcomes(comm, mine);
  if (error) {
    std::rethrow_exception(error);
  }
  const int r = firstFailed(all);
  HDDP_CHECK_AS(E, r < 0, what, " failed on rank ", r, ": ",
                r < 0 ? std::string() : all[static_cast<size_t>(r)].message);
}

}  // namespace hddp
