// A communicator with NCCL's semantics on CPU ranks, for tests.
//
// NCCL's Work::wait() only makes the device stream wait for the collective: the host
// returns at once, and a result is only guaranteed to the host at a later
// synchronization point (a host read of a device tensor, a stream synchronize). This
// decorator gives a CPU communicator the same shape: the Work of an allreduce returns
// from wait() at once and its result (and the inner Work's completion, e.g. Avg's
// division) is only guaranteed after synchronize(), which blocks until every deferred
// allreduce has completed. So on CPU ranks the host waits for the slower ranks where it
// would on a GPU: at the synchronization after backward, not in DDP's wait().
//
// Only allreduce is deferred (what DDP's buckets use); the other collectives first
// complete what is deferred, then run as the inner communicator runs them, since the
// code that calls them reads their results on the host at once.
#pragma once

#include <memory>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "comm/work_impl.h"
#include "hddp/comm/communicator.h"

namespace hddp {
namespace testing {

class StreamSemanticsCommunicator final : public Communicator {
 public:
  explicit StreamSemanticsCommunicator(std::unique_ptr<Communicator> inner)
      : inner_(std::move(inner)) {}
  ~StreamSemanticsCommunicator() override {
    try {
      synchronize();
    } catch (...) {
    }
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Backend backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  c10::Device device() const override { return inner_->device(); }
  // The Works it defers are its own; the others are the inner communicator's.
  RemovableHandle addWaitObserver(WaitObserver& observer) override {
    auto both = std::make_shared<std::pair<RemovableHandle, RemovableHandle>>(
        Communicator::addWaitObserver(observer), inner_->addWaitObserver(observer));
    return RemovableHandle([both] {
      both->first.remove();
      both->second.remove();
    });
  }

  Work allreduce(at::Tensor& tensor, const AllreduceOptions& options = {}) override {
    return defer(inner_->allreduce(tensor, options));
  }
  Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                          const AllreduceOptions& options = {}) override {
    return defer(inner_->allreduceCoalesced(tensors, options));
  }
  using Communicator::allreduce;
  using Communicator::broadcast;
  using Communicator::reduceScatter;
  Work broadcast(at::Tensor& tensor, const BroadcastOptions& options) override {
    synchronize();
    return inner_->broadcast(tensor, options);
  }
  Work reduce(at::Tensor& tensor, const ReduceOptions& options) override {
    return defer(inner_->reduce(tensor, options));
  }
  Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                 const AllgatherOptions& options = {}) override {
    synchronize();
    return inner_->allgather(outputs, input, options);
  }
  Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                     const ReduceScatterOptions& options) override {
    synchronize();
    return inner_->reduceScatter(output, input, options);
  }
  Work barrier(const BarrierOptions& options = {}) override {
    synchronize();
    return inner_->barrier(options);
  }

  /// The synchronization point: blocks until every deferred allreduce has completed.
  void synchronize() override {
    ++synchronizations_;
    std::vector<Work> pending;
    pending.swap(pending_);
    for (auto& w : pending) {
      w.wait();
    }
  }

  /// Allreduces whose wait() returned before they completed (for the test's own check
  /// that the double deferred something).
  int deferredCompletions() const { return deferredCompletions_; }
  int synchronizations() const { return synchronizations_; }

 private:
  // wait() returns at once; completion and the future are the inner collective's.
  class DeferredWork final : public c10d::Work {
   public:
    DeferredWork(c10::intrusive_ptr<c10d::Work> inner, int* deferred)
        : inner_(std::move(inner)), deferred_(deferred) {}
    bool isCompleted() override { return !inner_ || inner_->isCompleted(); }
    bool wait(std::chrono::milliseconds /*timeout*/) override {
      if (!isCompleted()) {
        ++*deferred_;
      }
      return true;
    }
    void synchronize() override {}
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
      return inner_ ? inner_->getFuture() : c10d::Work::getFuture();
    }

   private:
    c10::intrusive_ptr<c10d::Work> inner_;
    int* deferred_;
  };

  Work defer(Work inner) {
    if (!WorkAccess::impl(inner)->work) {
      return inner;  // completed on creation
    }
    auto impl = std::make_unique<WorkAccess::Impl>();
    impl->work =
        c10::make_intrusive<DeferredWork>(WorkAccess::impl(inner)->work, &deferredCompletions_);
    impl->description = inner.description() + " (deferred to synchronize())";
    impl->waitObservers = waitObservers();
    pending_.push_back(std::move(inner));
    return WorkAccess::make(std::move(impl));
  }

  std::unique_ptr<Communicator> inner_;
  std::vector<Work> pending_;
  int deferredCompletions_ = 0;
  int synchronizations_ = 0;
};

}  // namespace testing
}  // namespace hddp
