// PowerSgdState's own methods (hddp/ddp/power_sgd.h): its options' checks, its state
// dict, and the undo of a step that is not applied. The hook is in power_sgd.cpp.
#include <ATen/ATen.h>

#include <string>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/power_sgd.h"

namespace hddp {

PowerSgdState::PowerSgdState(PowerSgdOptions options) : options_(options) {
  HDDP_CHECK_AS(ConfigError, options_.rank >= 1, "PowerSgdOptions::rank must be at least 1, got ",
                options_.rank);
  HDDP_CHECK_AS(ConfigError,
                options_.startStep > 1 || !(options_.errorFeedback || options_.warmStart),
                "PowerSgdOptions::startStep must be at least 2 with error feedback or warm "
                "start (PyTorch's rule: DDP lays its buckets out anew after the first step, "
                "and a hook's buckets made by hand have no names to key memories by), got ",
                options_.startStep);
  HDDP_CHECK_AS(ConfigError, options_.minCompressionRate > 0,
                "PowerSgdOptions::minCompressionRate must be positive, got ",
                options_.minCompressionRate);
  HDDP_CHECK_AS(ConfigError, options_.orthogonalizationEpsilon >= 0,
                "PowerSgdOptions::orthogonalizationEpsilon must not be negative, got ",
                options_.orthogonalizationEpsilon);
  HDDP_CHECK_AS(ConfigError,
                options_.wireType == c10::ScalarType::Undefined ||
                    options_.wireType == at::kFloat || options_.wireType == at::kDouble ||
                    options_.wireType == at::kHalf || options_.wireType == at::kBFloat16,
                "PowerSgdOptions::wireType must be Undefined (the gradients' type), Float, "
                "Double, Half or BFloat16, got ",
                options_.wireType);
}

std::vector<std::pair<std::string, at::Tensor>> PowerSgdState::stateDict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("step", at::tensor(step_, at::kLong));
  out.emplace_back("draws", at::tensor(draws_, at::kLong));
  for (const auto& e : error_) {
    out.emplace_back("error/" + e.first, e.second.cpu().clone());
  }
  for (const auto& q : q_) {
    out.emplace_back("q/" + q.first, q.second.cpu().clone());
  }
  return out;
}

void PowerSgdState::loadStateDict(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::map<std::string, at::Tensor> error;
  std::map<std::string, at::Tensor> q;
  int64_t step = step_;
  int64_t draws = draws_;
  // An earlier hddp's per-bucket memories: "error.<bucket>", "q.<bucket>".
  auto perBucket = [](const std::string& key, size_t prefix) {
    return key.size() > prefix && key.find_first_not_of("0123456789", prefix) == std::string::npos;
  };
  int dropped = 0;
  for (const auto& item : state) {
    const std::string& key = item.first;
    if (key == "step" || key == "draws") {
      HDDP_CHECK(item.second.numel() == 1, "PowerSGD state: '", key, "' holds ",
                 item.second.numel(), " elements, expected one");
      const int64_t value = item.second.item<int64_t>();
      // The count of drawn Qs seeds the next draw by advancing a generator that far:
      // bounded, so a damaged file cannot stall every rank at its first draw.
      HDDP_CHECK(value >= 0 && (key == "step" || value <= (int64_t{1} << 32)), "PowerSGD state: '",
                 key, "' is ", value, ", out of range (a damaged state?)");
      (key == "step" ? step : draws) = value;
    } else if (key.rfind("error/", 0) == 0 && key.size() > 6) {
      error[key.substr(6)] = item.second;
    } else if (key.rfind("q/", 0) == 0 && key.size() > 2) {
      q[key.substr(2)] = item.second;
    } else if (perBucket(key, 6) && key.rfind("error.", 0) == 0) {
      ++dropped;
    } else if (perBucket(key, 2) && key.rfind("q.", 0) == 0) {
      ++dropped;
    } else {
      HDDP_THROW(Error, "PowerSGD state: unknown key '", key,
                 "' (expected step, draws, error/<parameter>, q/<parameter>)");
    }
  }
  if (dropped > 0) {
    HDDP_LOG_WARN("ddp", "PowerSGD state: ", dropped,
                  " memories kept per bucket (an earlier hddp's state) are dropped: the "
                  "memories are per parameter now; compression goes on from fresh memories");
  }
  step_ = step;
  draws_ = draws;
  error_ = std::move(error);
  q_ = std::move(q);
  startLogged_ = step_ >= options_.startStep;
  undo_ = StepUndo{};  // a loaded state is where the next step starts
}

void PowerSgdState::resetMemories(const std::string& why) {
  if (!error_.empty() || !q_.empty()) {
    HDDP_LOG_INFO("ddp", "PowerSGD: error and Q memories reset (", why, ")");
  }
  error_.clear();
  q_.clear();
  undo_ = StepUndo{};  // a discard must not bring the dropped memories back
}

void PowerSgdState::beginStep() {
  undo_.open = true;
  undo_.lastSeen = false;
  undo_.finite = true;
  undo_.step = step_;
  undo_.draws = draws_;
  // The memories' tensors are replaced at a step's end, never written in place: holding
  // the maps holds the state before the step.
  undo_.error = error_;
  undo_.q = q_;
  undo_.startLogged = startLogged_;
}

void PowerSgdState::undoMemories() {
  draws_ = undo_.draws;
  error_ = undo_.error;
  q_ = undo_.q;
}

void PowerSgdState::discardStep() {
  if (!undo_.open) {
    return;  // no step since the last discard or load
  }
  undoMemories();
  step_ = undo_.step;
  startLogged_ = undo_.startLogged;
  undo_ = StepUndo{};
}

}  // namespace hddp
