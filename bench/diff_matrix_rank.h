// One rank's training run of a differential-matrix case (bench/diff_matrix.cpp runs the
// ranks as threads; tools/diff-matrix/cases.py says what a case holds).
#pragma once

#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "hddp/hddp.h"

namespace diff_matrix {

using Tensors = std::map<std::string, at::Tensor>;

// The steps a run trains: all of them, or (a case with "resume") the steps before the
// save on the first world size and the rest, after a load, on the second.
struct Phase {
  size_t begin = 0;  // the first step
  size_t end = 0;    // one past the last step
  // Non-empty: after `end`, the state is saved into this folder through hddp's and
  // LibTorch's own save functions (model: hddp::saveStateDict; optimizer: its save(), or
  // ShardedOptimizer::saveShard per rank; GradScaler::save; PowerSgdState::stateDict).
  std::string saveDir;
  // Non-empty: before `begin`, that state is loaded from this folder, as saved by
  // `savedWorld` ranks.
  std::string loadDir;
  int savedWorld = 0;
};

struct RankResult {
  // `param/<name>`, `buffer/<name>`, `state/<name>/<key>`, `scaler/...`: what this rank
  // holds at the end.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  // Per step of the phase: {"buckets": the parameter names of each bucket its
  // synchronized backward sent, in bucket order; "shards": under ZeRO the names of each
  // rank's shard, else null}. The reference needs them where the order of a rounded sum
  // depends on where an element sits (compression or float32 sums on 3 ranks; ZeRO's
  // clipping norm in float32).
  nlohmann::json layout = nlohmann::json::array();
};

RankResult runRank(const nlohmann::json& cfg, const Tensors& data, int rank, int size,
                   hddp::Store& store, const Phase& phase);

}  // namespace diff_matrix
