// Who is told when a rank waits for the others: an observer of a communicator's waits,
// registered with a handle that unregisters it once (as torchcomms' RemovableHandle).
//
// The Trainer observes its communicator so that the time a rank blocks for a slower one
// counts as waiting, not compute: DDP's buckets, SyncBatchNorm's statistics, a user's
// own collectives. On Gloo the host blocks in Work::wait(); on NCCL the stream waits
// and a device timer's events fall around that wait.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace hddp {

/// Told when the calling thread starts and stops waiting for a collective
/// (Work::wait(), Work::synchronize()). Called on the waiting thread; endWait() follows
/// every beginWait(), also when the wait throws.
class WaitObserver {
 public:
  virtual ~WaitObserver() = default;
  virtual void beginWait() = 0;
  virtual void endWait() = 0;
};

/// Undoes one registration, once: remove(), or when destroyed. Movable, not copyable;
/// a default-constructed handle removes nothing. Safe to destroy after the object it
/// registered with is gone.
class RemovableHandle {
 public:
  RemovableHandle() = default;
  explicit RemovableHandle(std::function<void()> remove) : remove_(std::move(remove)) {}
  RemovableHandle(RemovableHandle&& other) noexcept : remove_(std::move(other.remove_)) {
    other.remove_ = nullptr;
  }
  RemovableHandle& operator=(RemovableHandle&& other) noexcept {
    if (this != &other) {
      remove();
      remove_ = std::move(other.remove_);
      other.remove_ = nullptr;
    }
    return *this;
  }
  RemovableHandle(const RemovableHandle&) = delete;
  RemovableHandle& operator=(const RemovableHandle&) = delete;
  ~RemovableHandle() { remove(); }

  void remove() noexcept {
    if (remove_) {
      auto f = std::move(remove_);
      remove_ = nullptr;
      try {
        f();
      } catch (...) {  // a handle's removal never throws out of a destructor
      }
    }
  }

 private:
  std::function<void()> remove_;
};

namespace detail {

/// A communicator's observers, shared with the Works it hands out (a Work may outlive
/// its communicator). Thread-safe.
class WaitObservers {
 public:
  void add(WaitObserver* observer);
  void remove(WaitObserver* observer);
  /// The observers registered now (a wait tells the same ones when it ends).
  std::vector<WaitObserver*> current() const;

 private:
  mutable std::mutex mutex_;
  std::vector<WaitObserver*> observers_;
};

}  // namespace detail
}  // namespace hddp
