#include "hddp/data/distributed_sampler.h"

#include <torch/serialize/archive.h>

#include <numeric>

#include "hddp/core/error.h"

namespace hddp {
namespace {

// splitmix64: a portable generator, so every rank and platform shuffles identically.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t datasetSize, SamplerOptions options)
    : size_(datasetSize), options_(options) {
  HDDP_CHECK(datasetSize > 0, "DistributedSampler needs a non-empty dataset, got ", datasetSize,
             " samples");
  HDDP_CHECK(options.minLocalBatch >= 0, "SamplerOptions::minLocalBatch must be >= 0, got ",
             options.minLocalBatch);
  setEpoch(0);
}

void DistributedSampler::setEpoch(int64_t epoch) {
  HDDP_CHECK(epoch >= 0, "DistributedSampler::setEpoch: epoch must be >= 0, got ", epoch);
  epoch_ = epoch;
  position_ = 0;
  permutation_.resize(static_cast<size_t>(size_));
  std::iota(permutation_.begin(), permutation_.end(), int64_t(0));
  if (options_.shuffle) {
    uint64_t state = options_.seed * 0x100000001B3ull + static_cast<uint64_t>(epoch) + 1;
    for (int64_t i = size_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(i + 1));
      std::swap(permutation_[static_cast<size_t>(i)], permutation_[static_cast<size_t>(j)]);
    }
  }
}

bool DistributedSampler::epochDone(int64_t globalBatch) const {
  const int64_t left = size_ - position_;
  return left <= 0 || (options_.dropLast && left < globalBatch);
}

// How many samples the next step takes: plan.global, all that is left when that is
// less, or all that is left when the rest after this step could not give every rank
// its minimum.
int64_t DistributedSampler::nextStepSize(const BatchPlan& plan) const {
  const int64_t left = size_ - position_;
  const int64_t floor = static_cast<int64_t>(plan.local.size()) * options_.minLocalBatch;
  if (left <= plan.global) {
    return left;
  }
  const int64_t after = left - plan.global;
  return !options_.dropLast && after < floor ? left : plan.global;
}

StepShare DistributedSampler::next(const BatchPlan& plan, int rank) {
  HDDP_CHECK(plan.global > 0, "DistributedSampler::next: the plan's global batch is ", plan.global);
  HDDP_CHECK(rank >= 0 && rank < static_cast<int>(plan.local.size()),
             "DistributedSampler::next: rank ", rank, " is not in a plan of ", plan.local.size(),
             " ranks");
  HDDP_CHECK(!epochDone(plan.global), "DistributedSampler: epoch ", epoch_,
             " is done; call setEpoch(epoch + 1) to start the next");
  const int64_t take = nextStepSize(plan);
  const int64_t floor = static_cast<int64_t>(plan.local.size()) * options_.minLocalBatch;
  HDDP_CHECK(take >= floor, "DistributedSampler: ", take, " sample(s) left in epoch ", epoch_,
             " cannot give each of ", plan.local.size(), " ranks its minimum of ",
             options_.minLocalBatch,
             " (the dataset, or what a resumed state left, is smaller "
             "than ranks x minLocalBatch)");
  StepShare share;
  share.plan = take == plan.global ? plan : scalePlan(plan, take, options_.minLocalBatch);
  share.globalBatch = share.plan.global;
  share.localBatch = share.plan.local[static_cast<size_t>(rank)];
  const int64_t begin = position_ + share.plan.offsetOf(rank);
  share.indices.assign(permutation_.begin() + begin,
                       permutation_.begin() + begin + share.localBatch);
  position_ += share.globalBatch;
  return share;
}

void DistributedSampler::restore(const State& state) {
  HDDP_CHECK(state.position >= 0 && state.position <= size_,
             "DistributedSampler::restore: position ", state.position, " is outside a dataset of ",
             size_, " samples (was the state saved for another dataset?)");
  setEpoch(state.epoch);
  position_ = state.position;
}

void DistributedSampler::State::save(torch::serialize::OutputArchive& archive) const {
  archive.write("sampler", at::tensor(std::vector<int64_t>{epoch, position}, at::kLong));
}

DistributedSampler::State DistributedSampler::State::load(torch::serialize::InputArchive& archive) {
  at::Tensor t;
  HDDP_CHECK_AS(StateError, archive.try_read("sampler", t) && t.numel() == 2,
                "the state has no sampler position (written by another program or an "
                "incompatible hddp version?)");
  t = t.contiguous();
  return State{t.data_ptr<int64_t>()[0], t.data_ptr<int64_t>()[1]};
}

}  // namespace hddp
