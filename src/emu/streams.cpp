#include "emu/streams.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>
#include <map>
#include <vector>

#include "emu/runtime.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

std::mutex& registryMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

// Leaked on purpose: workers may still run tasks while the process exits.
std::map<std::pair<c10::DeviceIndex, c10::StreamId>, StreamWorker*>& registry() {
  static auto* workers = new std::map<std::pair<c10::DeviceIndex, c10::StreamId>, StreamWorker*>;
  return *workers;
}

std::mutex& markerMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}

std::condition_variable& markerChanged() {
  static auto* cv = new std::condition_variable;
  return *cv;
}

}  // namespace

StreamWorker::StreamWorker(c10::Stream stream) : stream_(stream) {
  thread_ = std::thread([this] { run(); });
  thread_.detach();
}

void StreamWorker::enqueue(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(std::move(task));
  ++enqueued_;
  changed_.notify_all();
}

void StreamWorker::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = enqueued_;
  changed_.wait(lock, [&] { return completed_ >= target; });
}

bool StreamWorker::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ == enqueued_;
}

void StreamWorker::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return !queue_.empty(); });
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    const int64_t delay = streamDelayMs().load();
    if (delay > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    }
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "hddp::emu: a task queued on emu:%d stream %lld failed: %s\n",
                   static_cast<int>(stream_.device_index()), static_cast<long long>(stream_.id()),
                   e.what());
    }
    // The task's captured tensors are released here, outside the lock: their memory
    // returns to the allocator only now that the task ran.
    task = nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    ++completed_;
    changed_.notify_all();
  }
}

StreamWorker& worker(c10::Stream stream) {
  TORCH_INTERNAL_ASSERT(stream.id() != 0, "the default stream has no worker");
  std::lock_guard<std::mutex> lock(registryMutex());
  auto& slot = registry()[{stream.device_index(), stream.id()}];
  if (!slot) {
    slot = new StreamWorker(stream);
  }
  return *slot;
}

void drainDevice(c10::DeviceIndex device) {
  std::vector<StreamWorker*> workers;
  {
    std::lock_guard<std::mutex> lock(registryMutex());
    for (auto& [key, w] : registry()) {
      if (key.first == device) {
        workers.push_back(w);
      }
    }
  }
  for (auto* w : workers) {
    w->drain();
  }
}

c10::StreamId newStreamId() {
  static std::atomic<c10::StreamId> next{kPoolSize + 1};
  return next.fetch_add(1);
}

void completeMarker(Marker& marker) {
  std::lock_guard<std::mutex> lock(markerMutex());
  marker.when = std::chrono::steady_clock::now();
  marker.done.store(true);
  markerChanged().notify_all();
}

void waitMarker(const Marker& marker) {
  std::unique_lock<std::mutex> lock(markerMutex());
  markerChanged().wait(lock, [&] { return marker.done.load(); });
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
