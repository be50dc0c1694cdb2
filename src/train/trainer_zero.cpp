// Trainer::Impl (train/trainer_impl.h): ZeRO, the optimizer sharded across ranks by
// TrainerOptions::shardBy (hddp/ddp/sharded_optimizer.h).
#include <algorithm>
#include <array>
#include <cmath>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/trainer_impl.h"

namespace hddp {

void Trainer::Impl::shardOptimizer() {
  ShardedOptimizerOptions zero;
  zero.stage = options_.zero;
  zero.gatherChunkBytes = options_.ddp.bucketCapBytes;  // what is in flight stays a bucket
  const int rank = comm_.rank();
  switch (options_.shardBy.kind) {
    case ShardBy::Kind::Equal:
      break;
    case ShardBy::Kind::Ratios:
      zero.weights = options_.shardBy.ratios;
      break;
    case ShardBy::Kind::Memory: {
      // What is free now, with the model on the device and before any gradient or
      // optimizer state: what the shard (and the activations) will live in.
      const double free = balance_->memory().freeBytes();
      // Stage 1 keeps a buffer for every gradient on every rank: that is not free for
      // the shard. Nor is a step's working set: about four of the larger of a bucket
      // and the largest tensor (a bucket being reduced while the next fills, the
      // optimizer's temporaries, a chunk of the parameters being gathered).
      double gradientBytes = 0;
      double largestTensor = 0;
      for (const auto& p : ddp_->parameters()) {
        gradientBytes += static_cast<double>(p.nbytes());
        largestTensor = std::max(largestTensor, static_cast<double>(p.nbytes()));
      }
      const double bucket =
          std::min(static_cast<double>(options_.ddp.bucketCapBytes), gradientBytes);
      const double room =
          free - 4.0 * std::max(bucket, largestTensor) - (options_.zero == 1 ? gradientBytes : 0.0);
      // One exchange of (free, room) and every rank decides alike from the same figures.
      std::vector<double> frees;
      std::vector<double> rooms;
      bool unknown = false;
      double roomSum = 0;
      double freeSum = 0;
      for (const auto& said : allgatherValue(comm_, std::array<double, 2>{free, room})) {
        const double f = said[0];
        const double r = said[1];
        unknown = unknown || !(f >= 0) || !std::isfinite(f);
        frees.push_back(std::isfinite(f) ? std::max(0.0, f) : 0.0);
        rooms.push_back(std::isfinite(r) ? std::max(0.0, r) : 0.0);
        freeSum += frees.back();
        roomSum += rooms.back();
      }
      if (unknown || freeSum <= 0) {
        HDDP_LOG_SHARED("train", rank,
                        "ZeRO: a rank's free device memory cannot be measured (a CPU rank): "
                        "equal shards. Give --shard-by R0:R1:... or emulated memory "
                        "(--emulate-memory) to size them");
        break;
      }
      if (roomSum <= 0) {
        HDDP_LOG_SHARED("train", rank, "ZeRO: no rank has room for a shard beyond a step's ",
                        "working set; shards by free memory, which may not fit");
        zero.weights = frees;
      } else {
        zero.weights = rooms;
      }
      break;
    }
  }
  sharded_ = std::make_unique<ShardedOptimizer>(*ddp_, optimizer_, zero);
  HDDP_LOG_SHARED("train", rank, "ZeRO-", options_.zero, ", shards by ",
                  describeShardBy(options_.shardBy), ": ", sharded_->layout().describe());
}

}  // namespace hddp
