#include "hddp/data/loader.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

using Clock = std::chrono::steady_clock;

std::string describeException(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

class PrefetchLoader::Impl {
 public:
  // One prepared (or failed) batch, in host memory.
  struct Produced {
    Batch batch;
    DistributedSampler::State after;
    std::string error;  // non-empty: loading failed; raised by next()
  };

  Impl(std::shared_ptr<const Dataset> dataset, int rank, LoaderOptions options)
      : dataset_(std::move(dataset)),
        rank_(rank),
        options_(std::move(options)),
        sampler_(dataset_ ? dataset_->size() : 0, options_.sampler) {
    HDDP_CHECK_AS(ConfigError, dataset_ != nullptr, "PrefetchLoader needs a dataset");
    HDDP_CHECK_AS(ConfigError, options_.workers >= 0 && options_.depth >= 1,
                  "LoaderOptions: workers must be >= 0 and depth >= 1, got workers=",
                  options_.workers, " depth=", options_.depth);
    onDevice_ = options_.device.type() != c10::kCPU;
    // Pinned host batches for any device (CUDA, or an accelerator such as hddp::emu):
    // only from pinned memory is the side-stream copy asynchronous.
    pinned_ = onDevice_ && options_.pinMemory;
    consumed_ = sampler_.state();
    for (int i = 0; i < options_.workers; ++i) {
      workers_.emplace_back([this] { workerLoop(); });
    }
  }

  ~Impl() { stop(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) {
        return;
      }
      stopped_ = true;
      ++generation_;
      ready_.clear();
    }
    cv_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
    workers_.clear();
    staged_.reset();
  }

  void startEpoch(int64_t epoch, const BatchPlan& plan) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      checkRunning();
      sampler_.setEpoch(epoch);
      restartLocked(plan, sampler_.state(), 0);
    }
    cv_.notify_all();
  }

  void resume(const DistributedSampler::State& state, const BatchPlan& plan) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      checkRunning();
      sampler_.restore(state);
      restartLocked(plan, sampler_.state(), plan.global > 0 ? state.position / plan.global : 0);
    }
    cv_.notify_all();
  }

  void setPlan(const BatchPlan& plan) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      checkRunning();
      if (plan.local == plan_.local && plan.global == plan_.global) {
        return;
      }
      // Rewind to the first step next() has not returned, and prepare again.
      sampler_.restore(consumed_);
      restartLocked(plan, consumed_, consumedStep_);
    }
    cv_.notify_all();
  }

  std::optional<Batch> next() {
    checkRunning();
    std::optional<Produced> current;
    double wait = 0;
    if (staged_) {
      current = std::move(staged_);
      staged_.reset();
    } else {
      const auto t0 = Clock::now();
      current = take(/*block=*/true);
      wait = std::chrono::duration<double>(Clock::now() - t0).count();
      if (current && current->error.empty()) {
        toDevice(current->batch);
      }
    }
    if (!current) {
      return std::nullopt;
    }
    if (!current->error.empty()) {
      HDDP_THROW(DataError, current->error);
    }
    consumed_ = current->after;
    consumedStep_ = current->batch.stepInEpoch + 1;
    Batch out = std::move(current->batch);
    out.waitSeconds = wait;
    // Start copying the following batch to the device now, so the copy overlaps this
    // batch's compute (only when it is already prepared: never block here).
    if (onDevice_ && options_.workers > 0) {
      auto following = take(/*block=*/false);
      if (following && following->error.empty()) {
        toDevice(following->batch);
      }
      staged_ = std::move(following);
    }
    if (onDevice_ && out.copied) {
      c10::impl::VirtualGuardImpl impl(options_.device.type());
      const c10::Stream compute = impl.getStream(options_.device);
      out.copied->block(compute);  // the compute stream waits for the copy, not the host
      for (const auto* t : {&out.input, &out.target}) {
        if (t->defined()) {
          impl.recordDataPtrOnStream(t->storage().data_ptr(), compute);
        }
      }
    }
    return out;
  }

  DistributedSampler::State state() const { return consumed_; }

  int64_t stepsLeftInEpoch() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!active_ || plan_.global <= 0) {
      return 0;
    }
    const int64_t remaining = dataset_->size() - consumed_.position;
    const int64_t full = remaining / plan_.global;
    const int64_t rest = remaining % plan_.global;
    if (options_.sampler.dropLast || rest == 0) {
      return full;
    }
    // A rest too small for every rank's minimum joins the step before (the sampler).
    const auto floor = static_cast<int64_t>(plan_.local.size()) * options_.sampler.minLocalBatch;
    return rest < floor && full > 0 ? full : full + 1;
  }

  const Dataset& dataset() const { return *dataset_; }
  const LoaderOptions& options() const { return options_; }

 private:
  struct Job {
    int64_t seq = 0;
    uint64_t generation = 0;
    Produced produced;
  };

  void checkRunning() const { HDDP_CHECK(!stopped_, "the loader was stopped; create a new one"); }

  void restartLocked(const BatchPlan& plan, const DistributedSampler::State& from, int64_t step) {
    HDDP_CHECK_AS(ConfigError,
                  plan.global > 0 && rank_ >= 0 && rank_ < static_cast<int>(plan.local.size()),
                  "loader plan ", plan.describe(), " has no share for rank ", rank_);
    plan_ = plan;
    ++generation_;
    ready_.clear();
    staged_.reset();
    nextAssign_ = nextConsume_;
    assignStep_ = step;
    consumed_ = from;
    consumedStep_ = step;
    active_ = true;
  }

  bool canAssignLocked() const {
    return active_ && !sampler_.epochDone(plan_.global) &&
           nextAssign_ - nextConsume_ < options_.depth;
  }

  // Takes the next step's share from the sampler (under the lock).
  Job assignLocked() {
    Job job;
    job.seq = nextAssign_++;
    job.generation = generation_;
    Batch& b = job.produced.batch;
    b.epoch = sampler_.epoch();
    b.stepInEpoch = assignStep_++;
    try {
      b.share = sampler_.next(plan_, rank_);
    } catch (...) {
      job.produced.error = describeException(std::current_exception());
    }
    job.produced.after = sampler_.state();
    return job;
  }

  // Reads, augments and collates a job's samples (outside the lock).
  void build(Job& job) const {
    Produced& p = job.produced;
    if (!p.error.empty()) {
      return;
    }
    Batch& b = p.batch;
    std::vector<Example> examples;
    examples.reserve(b.share.indices.size());
    for (int64_t index : b.share.indices) {
      try {
        SampleRng rng(sampleSeed(options_.seed, b.epoch, index));
        examples.push_back(dataset_->get(index, rng));
      } catch (...) {
        p.error = "loading sample " + std::to_string(index) + " (epoch " + std::to_string(b.epoch) +
                  ", step " + std::to_string(b.stepInEpoch) + ", rank " + std::to_string(rank_) +
                  ") failed: " + describeException(std::current_exception());
        return;
      }
    }
    if (examples.empty()) {
      return;  // this rank has no samples in this step
    }
    try {
      Example batch = collate(examples, pinned_);
      b.input = batch.input;
      b.target = batch.target;
      b.bytes = static_cast<int64_t>(b.input.nbytes() + b.target.nbytes());
    } catch (...) {
      p.error = "collating step " + std::to_string(b.stepInEpoch) + " of epoch " +
                std::to_string(b.epoch) + " failed: " + describeException(std::current_exception());
    }
  }

  void workerLoop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopped_ || canAssignLocked(); });
        if (stopped_) {
          return;
        }
        job = assignLocked();
      }
      build(job);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (job.generation != generation_) {
          continue;  // the plan changed (or the epoch restarted) meanwhile
        }
        ready_.emplace(job.seq, std::move(job.produced));
      }
      cv_.notify_all();
    }
  }

  // The next batch in order; nullopt at the end of the epoch (or, with block=false,
  // when it is not ready yet).
  std::optional<Produced> take(bool block) {
    std::unique_lock<std::mutex> lock(mu_);
    HDDP_CHECK(active_, "PrefetchLoader::next() before startEpoch() or resume()");
    for (;;) {
      auto it = ready_.find(nextConsume_);
      if (it != ready_.end()) {
        Produced p = std::move(it->second);
        ready_.erase(it);
        ++nextConsume_;
        lock.unlock();
        cv_.notify_all();
        return p;
      }
      const bool exhausted = sampler_.epochDone(plan_.global) && nextAssign_ == nextConsume_;
      if (exhausted || stopped_) {
        return std::nullopt;
      }
      if (options_.workers == 0) {
        if (!block) {
          return std::nullopt;
        }
        Job job = assignLocked();
        lock.unlock();
        build(job);
        lock.lock();
        ready_.emplace(job.seq, std::move(job.produced));
        continue;
      }
      if (!block) {
        return std::nullopt;
      }
      cv_.wait(lock);
    }
  }

  // Moves a host batch to the device on the copy stream (asynchronously on CUDA).
  void toDevice(Batch& b) {
    if (!onDevice_ || !b.input.defined()) {
      return;
    }
    c10::impl::VirtualGuardImpl impl(options_.device.type());
    if (!copyStream_) {
      copyStream_ = impl.getStreamFromGlobalPool(options_.device, /*isHighPriority=*/false);
    }
    // Timing events (BACKEND_DEFAULT): the step timer reads the copy's duration.
    b.copyStarted =
        std::make_shared<c10::Event>(options_.device.type(), c10::EventFlag::BACKEND_DEFAULT);
    b.copyStarted->record(*copyStream_);
    {
      c10::StreamGuard guard(*copyStream_);
      const auto to = at::TensorOptions().device(options_.device);
      b.input = b.input.to(to, /*non_blocking=*/pinned_);
      b.target = b.target.to(to, /*non_blocking=*/pinned_);
    }
    b.copied =
        std::make_shared<c10::Event>(options_.device.type(), c10::EventFlag::BACKEND_DEFAULT);
    b.copied->record(*copyStream_);
  }

  std::shared_ptr<const Dataset> dataset_;
  int rank_;
  LoaderOptions options_;
  bool onDevice_ = false;
  bool pinned_ = false;
  std::optional<c10::Stream> copyStream_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  DistributedSampler sampler_;  // the production position
  BatchPlan plan_;
  bool active_ = false;
  bool stopped_ = false;
  uint64_t generation_ = 0;
  int64_t nextAssign_ = 0;
  int64_t nextConsume_ = 0;
  int64_t assignStep_ = 0;
  std::map<int64_t, Produced> ready_;
  std::vector<std::thread> workers_;

  // Training-thread side.
  DistributedSampler::State consumed_;
  int64_t consumedStep_ = 0;
  std::optional<Produced> staged_;
};

PrefetchLoader::PrefetchLoader(std::shared_ptr<const Dataset> dataset, int rank,
                               LoaderOptions options)
    : impl_(std::make_unique<Impl>(std::move(dataset), rank, std::move(options))) {}
PrefetchLoader::~PrefetchLoader() = default;
void PrefetchLoader::startEpoch(int64_t epoch, const BatchPlan& plan) {
  impl_->startEpoch(epoch, plan);
}
void PrefetchLoader::resume(const DistributedSampler::State& state, const BatchPlan& plan) {
  impl_->resume(state, plan);
}
void PrefetchLoader::setPlan(const BatchPlan& plan) { impl_->setPlan(plan); }
std::optional<Batch> PrefetchLoader::next() { return impl_->next(); }
DistributedSampler::State PrefetchLoader::state() const { return impl_->state(); }
void PrefetchLoader::stop() { impl_->stop(); }
const Dataset& PrefetchLoader::dataset() const { return impl_->dataset(); }
const LoaderOptions& PrefetchLoader::options() const { return impl_->options(); }
int64_t PrefetchLoader::stepsLeftInEpoch() const { return impl_->stepsLeftInEpoch(); }

}  // namespace hddp
