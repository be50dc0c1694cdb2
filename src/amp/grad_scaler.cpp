#include "hddp/amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

// Native kernel when the device has one, plain tensor ops otherwise.
void unscaleAndCheck(std::vector<at::Tensor>& grads, at::Tensor& foundInf,
                     const at::Tensor& invScale) {
  try {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, foundInf, invScale);
    return;
  } catch (const c10::NotImplementedError&) {
  }
  for (auto& g : grads) {
    foundInf.add_((~at::isfinite(g)).any().to(foundInf.scalar_type()));
    g.mul_(invScale.to(g.scalar_type()));
  }
  foundInf.clamp_max_(1);
}

void updateScale(at::Tensor& scale, at::Tensor& tracker, const at::Tensor& foundInf, double growth,
                 double backoff, int64_t interval) {
  try {
    at::_amp_update_scale_(scale, tracker, foundInf, growth, backoff, interval);
    return;
  } catch (const c10::NotImplementedError&) {
  }
  if (foundInf.item<float>() > 0) {
    scale.mul_(backoff);
    tracker.zero_();
  } else if (tracker.item<int>() + 1 >= interval) {
    scale.mul_(growth);
    tracker.zero_();
  } else {
    tracker.add_(1);
  }
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options, Communicator* communicator)
    : options_(options), communicator_(communicator) {
  HDDP_CHECK(options_.initScale > 0, "GradScaler: initScale must be positive, got ",
             options_.initScale);
  HDDP_CHECK(options_.growthFactor > 1.0, "GradScaler: growthFactor must be > 1, got ",
             options_.growthFactor);
  HDDP_CHECK(options_.backoffFactor > 0 && options_.backoffFactor < 1.0,
             "GradScaler: backoffFactor must be in (0, 1), got ", options_.backoffFactor);
  HDDP_CHECK(options_.growthInterval > 0, "GradScaler: growthInterval must be positive, got ",
             options_.growthInterval);
}

void GradScaler::lazyInit(const at::Device& device) {
  if (!scale_.defined()) {
    scale_ =
        at::full({1}, options_.initScale, at::TensorOptions().dtype(at::kFloat).device(device));
    growthTracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  } else if (scale_.device() != device) {
    scale_ = scale_.to(device);
    growthTracker_ = growthTracker_.to(device);
  }
}

// A rank with no samples in a step scales no loss, yet receives the others' scaled
// gradients and must take part in the found-inf agreement: its scale starts where
// every rank's starts (initScale) and has followed the same agreed updates since.
void GradScaler::initWithoutLoss(torch::optim::Optimizer& optimizer) {
  if (scale_.defined()) {
    return;
  }
  at::Device device = communicator_ ? communicator_->device() : at::Device(at::kCPU);
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      device = p.device();
      break;
    }
  }
  lazyInit(device);
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!options_.enabled) {
    return loss;
  }
  lazyInit(loss.device());
  // The scale stays float32 (65536 is inf in float16): type promotion makes the scaled
  // loss float32, as PyTorch's GradScaler does.
  return loss * scale_;
}

void GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    return;
  }
  initWithoutLoss(optimizer);
  PerOptimizer& state = perOptimizer_[&optimizer];
  HDDP_CHECK(!state.unscaled,
             "GradScaler::unscale called twice for one optimizer in one step; call update() "
             "after each step");
  HDDP_CHECK(!state.stepped, "GradScaler::unscale after step(): call update() first");
  at::Tensor invScale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  state.foundInf = at::zeros({1}, scale_.options());
  // One native call per (device, dtype) group, as PyTorch does.
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
  // A tensor listed twice (tied weights, or in two groups) is unscaled once.
  std::set<const void*> seen;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined() && seen.insert(p.grad().unsafeGetTensorImpl()).second) {
        groups[{p.grad().device().str(), static_cast<int>(p.grad().scalar_type())}].push_back(
            p.mutable_grad());
      }
    }
  }
  for (auto& entry : groups) {
    const at::Device device = entry.second.front().device();
    at::Tensor found = at::zeros({1}, scale_.options().device(device));
    unscaleAndCheck(entry.second, found, invScale.to(device));
    state.foundInf.add_(found.to(scale_.device()));
  }
  state.unscaled = true;
}

at::Tensor GradScaler::foundInfFor(torch::optim::Optimizer& optimizer) {
  PerOptimizer& state = perOptimizer_[&optimizer];
  if (!state.unscaled) {
    unscale(optimizer);
  }
  at::Tensor found = state.foundInf.clamp_max(1);
  if (communicator_ && communicator_->size() > 1) {
    at::Tensor onComm = found.to(communicator_->device());
    communicator_->allreduce(onComm, {ReduceOp::Max}).wait();
    found = onComm.to(found.device());
  }
  state.foundInf = found;
  return found;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  initWithoutLoss(optimizer);
  PerOptimizer& state = perOptimizer_[&optimizer];
  HDDP_CHECK(!state.stepped,
             "GradScaler::step called twice for one optimizer in one step; call update()");
  const bool skip = foundInfFor(optimizer).item<float>() > 0;
  state.stepped = true;
  if (skip) {
    HDDP_LOG_DEBUG("amp", "inf/NaN gradients: skipping the optimizer step at scale ",
                   currentScale());
    return false;
  }
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled || !scale_.defined()) {
    return;
  }
  HDDP_CHECK(!perOptimizer_.empty(),
             "GradScaler::update without unscale()/step() in this iteration");
  at::Tensor found = at::zeros({1}, scale_.options());
  for (auto& entry : perOptimizer_) {
    if (entry.second.foundInf.defined()) {
      found.add_(entry.second.foundInf.to(scale_.device()));
    }
  }
  found.clamp_max_(1);
  updateScale(scale_, growthTracker_, found, options_.growthFactor, options_.backoffFactor,
              options_.growthInterval);
  perOptimizer_.clear();
}

double GradScaler::currentScale() const {
  return scale_.defined() ? scale_.item<double>() : options_.initScale;
}

int64_t GradScaler::growthTracker() const {
  return growthTracker_.defined() ? growthTracker_.item<int64_t>() : 0;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", at::full({1}, currentScale(), at::kDouble));
  archive.write("growth_tracker", at::full({1}, growthTracker(), at::kLong));
  archive.write("growth_factor", at::full({1}, options_.growthFactor, at::kDouble));
  archive.write("backoff_factor", at::full({1}, options_.backoffFactor, at::kDouble));
  archive.write("growth_interval", at::full({1}, options_.growthInterval, at::kLong));
  archive.write("enabled", at::full({1}, options_.enabled ? 1 : 0, at::kLong));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  // InputArchive::read reuses a defined tensor (set_), so every key gets a fresh one.
  // Everything is read and checked before anything changes: a damaged entry leaves the
  // scaler as it was.
  auto read = [&archive](const char* key) {
    at::Tensor t;
    HDDP_CHECK_AS(StateError, archive.try_read(key, t), "GradScaler state: no '", key, "' entry");
    HDDP_CHECK_AS(StateError, t.numel() == 1, "GradScaler state: '", key, "' holds ", t.numel(),
                  " elements, expected one");
    return t;
  };
  const double scale = read("scale").item<double>();
  const int64_t tracker = read("growth_tracker").item<int64_t>();
  HDDP_CHECK_AS(StateError, tracker >= 0 && tracker <= std::numeric_limits<int32_t>::max(),
                "GradScaler state: 'growth_tracker' is ", tracker,
                ", not a count of steps (0 to 2^31 - 1)");
  GradScalerOptions loaded = options_;
  loaded.growthFactor = read("growth_factor").item<double>();
  loaded.backoffFactor = read("backoff_factor").item<double>();
  loaded.growthInterval = read("growth_interval").item<int64_t>();
  loaded.enabled = read("enabled").item<int64_t>() != 0;
  // What the constructor requires of its options, and a scale a float holds.
  HDDP_CHECK_AS(StateError,
                std::isfinite(scale) && scale > 0 && scale <= std::numeric_limits<float>::max(),
                "GradScaler state: 'scale' is ", scale, ", not a positive float");
  HDDP_CHECK_AS(StateError, loaded.growthFactor > 1.0, "GradScaler state: 'growth_factor' is ",
                loaded.growthFactor, ", not > 1");
  HDDP_CHECK_AS(StateError, loaded.backoffFactor > 0 && loaded.backoffFactor < 1.0,
                "GradScaler state: 'backoff_factor' is ", loaded.backoffFactor, ", not in (0, 1)");
  HDDP_CHECK_AS(StateError, loaded.growthInterval > 0, "GradScaler state: 'growth_interval' is ",
                loaded.growthInterval, ", not positive");
  const at::Device device = scale_.defined() ? scale_.device() : at::Device(at::kCPU);
  at::Tensor newScale = at::full({1}, scale, at::TensorOptions().dtype(at::kFloat).device(device));
  at::Tensor newTracker =
      at::full({1}, tracker, at::TensorOptions().dtype(at::kInt).device(device));
  // Nothing below allocates or throws.
  options_ = loaded;
  scale_ = std::move(newScale);
  growthTracker_ = std::move(newTracker);
  perOptimizer_.clear();
}

}  // namespace hddp
