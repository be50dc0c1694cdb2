#include "hddp/comm/work.h"

#include <pthread.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
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

using Clock = std::chrono::steady_clock;

// Completion callbacks of Works whose emulated link ends them after the real collective
// (link_emulation.h): run at their time by one thread of their own (started on first
// use, again in a forked child, never joined: it may outlive main's objects, so the
// queue lives as long as the process).
class DelayedCallbacks {
 public:
  static DelayedCallbacks& instance() {
    static std::once_flag once;
    std::call_once(once, [] {
      current() = new DelayedCallbacks();
      // A forked child starts with a queue of its own: the parent's callbacks are not
      // its own, and the parent's thread may have held the lock at the fork. (The old
      // one is left, as a child must not touch a lock it may never get.)
      ::pthread_atfork(nullptr, nullptr, [] { current() = new DelayedCallbacks(); });
    });
    return *current();
  }

  void at(Clock::time_point when, std::function<void()> callback) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.emplace(when, std::move(callback));
      if (owner_ != ::getpid()) {  // first use, or a forked child (threads do not fork)
        owner_ = ::getpid();
        std::thread([this] { run(); }).detach();
      }
    }
    wake_.notify_one();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (queue_.empty()) {
        wake_.wait(lock);
        continue;
      }
      const auto first = queue_.begin();
      if (Clock::now() < first->first) {
        wake_.wait_until(lock, first->first);
        continue;
      }
      std::function<void()> callback = std::move(first->second);
      queue_.erase(first);
      lock.unlock();
      try {
        callback();
      } catch (...) {  // callbacks must not throw (Work::onCompletion); never end the thread
      }
      lock.lock();
    }
  }

  static DelayedCallbacks*& current() {
    static DelayedCallbacks* callbacks = nullptr;
    return callbacks;
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::multimap<Clock::time_point, std::function<void()>> queue_;
  pid_t owner_ = 0;
};

// Sleeps until an emulated link's end of the collective.
void waitForEmulatedLink(const WorkAccess::Impl& impl) {
  if (impl.notBefore != Clock::time_point{} && Clock::now() < impl.notBefore) {
    std::this_thread::sleep_until(impl.notBefore);
  }
}

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
  return (!impl_->work || impl_->work->isCompleted()) &&
         (impl_->notBefore == Clock::time_point{} || Clock::now() >= impl_->notBefore);
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
  if (impl_->work || impl_->notBefore != Clock::time_point{}) {
    span.emplace(impl_->waitObservers);
  }
  if (impl_->work) {
    try {
      impl_->work->wait(timeout.count() > 0 ? timeout : std::chrono::milliseconds(0));
    } catch (...) {
      impl_->finished = true;  // the error is reported once; the work is over either way
      detail::rethrowAsDistributed(impl_->description, detail::FailedOperation::Backend);
    }
  }
  waitForEmulatedLink(*impl_);
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
  if (impl_->work || impl_->notBefore != Clock::time_point{}) {
    span.emplace(impl_->waitObservers);
  }
  if (impl_->work) {
    try {
      impl_->work->synchronize();
    } catch (...) {
      impl_->finished = true;
      detail::rethrowAsDistributed(impl_->description, detail::FailedOperation::Backend);
    }
  }
  waitForEmulatedLink(*impl_);
  impl_->finished = true;
  if (impl_->onComplete) {
    impl_->onComplete();
  }
}

void Work::onCompletion(std::function<void()> callback) {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  HDDP_CHECK(callback, "Work::onCompletion needs a callback");
  const Clock::time_point notBefore = impl_->notBefore;
  auto run = [notBefore](std::function<void()> fn) {
    if (notBefore != Clock::time_point{} && Clock::now() < notBefore) {
      DelayedCallbacks::instance().at(notBefore, std::move(fn));  // the emulated link's end
    } else {
      fn();
    }
  };
  if (!impl_->work) {
    run(std::move(callback));
    return;
  }
  impl_->work->getFuture()->addCallback(
      [run, callback = std::move(callback)](c10::ivalue::Future&) { run(callback); });
}

const std::string& Work::description() const {
  HDDP_CHECK(impl_, "Work used after it was moved from");
  return impl_->description;
}

}  // namespace hddp
