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
                "start (DDP rebuilds its buckets after the first step, which would misplace "
                "the memories), got ",
                options_.startStep);
  HDDP_CHECK_AS(ConfigError, options_.minCompressionRate > 0,
                "PowerSgdOptions::minCompressionRate must be positive, got ",
                options_.minCompressionRate);
  HDDP_CHECK_AS(ConfigError, options_.orthogonalizationEpsilon >= 0,
                "PowerSgdOptions::orthogonalizationEpsilon must not be negative, got ",
                options_.orthogonalizationEpsilon);
  HDDP_CHECK_AS(ConfigError,
                options_.wireType == at::kFloat || options_.wireType == at::kHalf ||
                    options_.wireType == at::kBFloat16,
                "PowerSgdOptions::wireType must be Float, Half or BFloat16, got ",
                options_.wireType);
}

std::vector<std::pair<std::string, at::Tensor>> PowerSgdState::stateDict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("step", at::tensor(step_, at::kLong));
  out.emplace_back("draws", at::tensor(draws_, at::kLong));
  for (const auto& e : error_) {
    out.emplace_back("error." + std::to_string(e.first), e.second.cpu().clone());
  }
  for (const auto& q : q_) {
    out.emplace_back("q." + std::to_string(q.first), q.second.cpu().clone());
  }
  return out;
}

void PowerSgdState::loadStateDict(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::map<int, at::Tensor> error;
  std::map<int, at::Tensor> q;
  int64_t step = step_;
  int64_t draws = draws_;
  auto bucketOf = [](const std::string& key, size_t prefix) {
    try {
      size_t used = 0;
      const int index = std::stoi(key.substr(prefix), &used);
      if (used == key.size() - prefix && index >= 0) {
        return index;
      }
    } catch (const std::exception&) {
    }
    HDDP_THROW(Error, "PowerSGD state: '", key, "' does not name a bucket");
  };
  for (const auto& item : state) {
    const std::string& key = item.first;
    if (key == "step") {
      step = item.second.item<int64_t>();
    } else if (key == "draws") {
      draws = item.second.item<int64_t>();
    } else if (key.rfind("error.", 0) == 0) {
      error[bucketOf(key, 6)] = item.second;
    } else if (key.rfind("q.", 0) == 0) {
      q[bucketOf(key, 2)] = item.second;
    } else {
      HDDP_THROW(Error, "PowerSGD state: unknown key '", key,
                 "' (expected step, draws, error.<bucket>, q.<bucket>)");
    }
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
