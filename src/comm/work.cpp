#include "hddp/comm/work.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "comm/errors.h"
#include "comm/work_impl.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

// A wait told to the communicator's observers, ended on every way out: the observers
// registered when it began are the ones told that it ended.
class WaitSpan {
 public:
  explicit WaitSpan(const std::shared_ptr<detail::WaitObservers>& observers) {
    if (!observers) {
      return;
    }
    for (WaitObserver* o : observers->current()) {
      try {
        o->beginWait();
      } catch (...) {
        end();  // those already told hear the end: every begin has its end
        throw;
      }
      told_.push_back(o);
    }
  }
  ~WaitSpan() { end(); }
  WaitSpan(const WaitSpan&) = delete;
  WaitSpan& operator=(const WaitSpan&) = delete;

 private:
  void end() noexcept {
    for (auto it = told_.rbegin(); it != told_.rend(); ++it) {
      try {
        (*it)->endWait();
      } catch (...) {  // an observer's failure must not replace the wait's own error
      }
    }
    told_.clear();
  }

  std::vector<WaitObserver*> told_;
};

}  // namespace

namespace detail {

void WaitObservers::add(WaitObserver* observer) {
  std::lock_guard<std::mutex> lock(mutex_);
  observers_.push_back(observer);
}

void WaitObservers::remove(WaitObserver* observer) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = std::find(observers_.begin(), observers_.end(), observer);
  if (it != observers_.end()) {
    observers_.erase(it);
  }
}

std::vector<WaitObserver*> WaitObservers::current() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return observers_;
}

}  // namespace detail

Work::Work() : impl_(std::make_unique<Impl>()) { impl_->description = "no-op"; }
Work::Work(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Work::~Work() = default;
Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&&) noexcept = default;

bool Work::isCompleted() const {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  return !impl_->work || impl_->work->isCompleted();
}

void Work::wait(std::chrono::milliseconds timeout) {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  if (impl_->finished) {
    return;
  }
  // The span covers what runs on completion too (a staged tensor's copy back to its
  // device, the Avg division): waiting for the collective's result, as Gloo's own
  // staging of CUDA tensors inside its wait.
  std::optional<WaitSpan> span;
  if (impl_->work) {
    span.emplace(impl_->waitObservers);
    try {
      impl_->work->wait(timeout.count() > 0 ? timeout : std::chrono::milliseconds(0));
    } catch (...) {
      impl_->finished = true;  // the error is reported once; the work is over either way
      detail::rethrowAsDistributed(impl_->description, detail::FailedOperation::Backend);
    }
  }
  impl_->finished = true;
  if (impl_->onComplete) {
    impl_->onComplete();
  }
}

void Work::synchronize() {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  if (impl_->finished) {
    return;
  }
  if (impl_->synchronizeWaits) {
    wait();
    return;
  }
  std::optional<WaitSpan> span;
  if (impl_->work) {
    span.emplace(impl_->waitObservers);
    try {
      impl_->work->synchronize();
    } catch (...) {
      impl_->finished = true;
      detail::rethrowAsDistributed(impl_->description, detail::FailedOperation::Backend);
    }
  }
  impl_->finished = true;
  if (impl_->onComplete) {
    impl_->onComplete();
  }
}

void Work::onCompletion(std::function<void()> callback) {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  HDDP_CHECK(callback, "Work::onCompletion needs a callback");
  if (!impl_->work) {
    callback();
    return;
  }
  impl_->work->getFuture()->addCallback(
      [callback = std::move(callback)](c10::ivalue::Future&) { callback(); });
}

const std::string& Work::description() const {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  return impl_->description;
}

}  // namespace hddp
