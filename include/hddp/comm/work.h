// Handle of an asynchronous collective.
//
// isCompleted() never blocks. wait() blocks until the operation is done (or `timeout`
// passes) and throws the stored error: hddp::TimeoutError or hddp::BackendError with
// the rank, the collective and the sizes. The result tensors are valid after wait().
// On CUDA, synchronize() instead makes the current stream wait for the collective
// without blocking the host.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace hddp {

/// One collective in flight. A value: movable, not copyable; it owns what the
/// collective needs until completion (staging copies, the Avg division).
/// Thread safety: one thread at a time may use a Work (wait, synchronize, query);
/// onCompletion callbacks run on the backend's thread. It may outlive its
/// communicator only once completed.
class Work {
 public:
  /// No timeout beyond the communicator's own.
  static constexpr std::chrono::milliseconds kNoTimeout{0};

  Work();  // an already completed no-op
  ~Work();
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  bool isCompleted() const;
  void wait(std::chrono::milliseconds timeout = kNoTimeout);
  void synchronize();
  /// What this work does, e.g. "allreduce(sum) of 3 tensors, 1.2 MB float32 on rank 1/4".
  const std::string& description() const;

  /// Runs `callback` once the backend has completed the collective (successfully or
  /// not): on a backend thread, or at once on this thread when it already has. It sees
  /// no result tensors (read those after wait()); it is for bookkeeping such as timing.
  /// It must not throw, block or wait on this Work. Like c10d's
  /// `getFuture()->addCallback`.
  void onCompletion(std::function<void()> callback);

 private:
  struct Impl;
  friend struct WorkAccess;  // the communicator's implementation builds Works
  explicit Work(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hddp
