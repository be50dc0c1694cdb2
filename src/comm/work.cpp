#include "hddp/comm/work.h"

#include "comm/errors.h"
#include "comm/work_impl.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

// The span of a wait on the communicator's step timer, closed on every way out.
class WaitSpan {
 public:
  explicit WaitSpan(StepTimer* timer) : timer_(timer) {
    if (timer_) {
      timer_->beginWait();
    }
  }
  ~WaitSpan() {
    if (timer_) {
      timer_->endWait();
    }
  }
  WaitSpan(const WaitSpan&) = delete;
  WaitSpan& operator=(const WaitSpan&) = delete;

 private:
  StepTimer* timer_;
};

}  // namespace

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
  if (impl_->work) {
    WaitSpan span(impl_->waitTimer);
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
  if (impl_->work) {
    WaitSpan span(impl_->waitTimer);
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
