// Work's implementation (private to the comm layer): a c10d::Work and what runs when it
// has completed.
#pragma once

#include <chrono>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "hddp/comm/wait_observer.h"
#include "hddp/comm/work.h"

namespace hddp {

struct Work::Impl {
  /// Null for work that completed on creation (e.g. an empty tensor list).
  c10::intrusive_ptr<c10d::Work> work;
  /// Runs once after the collective completed (Avg division, unflattening, ...).
  std::function<void()> onComplete;
  std::string description;
  bool finished = false;
  /// synchronize() waits as wait() does: Gloo's collectives complete on the host, where
  /// c10d's synchronize() returns at once, before what runs on completion may.
  bool synchronizeWaits = false;
  /// Told of wait() and synchronize() (Communicator::addWaitObserver); null: nobody.
  std::shared_ptr<detail::WaitObservers> waitObservers;
  /// An emulated slow link's end of this collective (hddp/comm/link_emulation.h): the
  /// Work completes no sooner. The clock's epoch: none.
  std::chrono::steady_clock::time_point notBefore{};
};

/// How the communicator's implementation builds a Work and edits it before handing it out.
struct WorkAccess {
  using Impl = Work::Impl;
  static Work make(std::unique_ptr<Work::Impl> impl) { return Work(std::move(impl)); }
  static Work::Impl* impl(Work& work) { return work.impl_.get(); }
};

}  // namespace hddp
