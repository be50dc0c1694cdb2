// The Trainer's options that shape the collectives, agreed (options_agreement.h).
#include "train/options_agreement.h"

#include <sstream>

#include "hddp/amp/amp_mode.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "hddp/train/trainer.h"

namespace hddp {
namespace train {
namespace {

template <typename T>
std::string text(const T& value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}

std::string given(const std::string& value) { return value.empty() ? "none" : "given"; }

}  // namespace

std::vector<std::pair<std::string, std::string>> collectiveShapingOptions(const TrainerOptions& o) {
  std::string caps;
  for (const int64_t cap : o.maxLocalBatch) {
    caps += (caps.empty() ? "" : ",") + text(cap);
  }
  const PlannerSettings& p = o.planner;
  const DdpOptions& d = o.ddp;
  const PowerSgdOptions& s = d.powerSgd;
  return {
      {"globalBatch", text(o.globalBatch)},
      {"epochs", text(o.epochs)},
      {"maxSteps", text(o.maxSteps)},
      {"timeBudgetSeconds", text(o.timeBudgetSeconds)},
      {"seed", text(o.seed)},
      // bf16 or off may differ by rank (--amp auto picks bf16 where it is native): only
      // fp16 brings collectives (the GradScaler's found-inf).
      {"amp.fp16", text(o.amp == AmpMode::Fp16)},
      {"clipGradNorm", text(o.clipGradNorm)},
      {"balance", text(o.balance)},
      {"seedPlan", text(o.seedPlan)},
      {"planner", text(p.rebalanceEvery) + "/" + text(p.calibrationSteps) + "/" + text(p.window) +
                      "/" + text(p.probeEvery) + "/" + text(p.minLocalBatch)},
      {"zero", text(o.zero)},
      {"shardBy", o.zero > 0 ? describeShardBy(o.shardBy) : "-"},
      {"scaler.enabled", text(o.scaler.enabled)},
      {"saveDir", given(o.saveDir)},
      {"saveEvery", text(o.saveEvery)},
      {"resume", given(o.resume)},
      {"resumeOnRestart", text(o.resumeOnRestart)},
      {"timelinePath", given(o.timelinePath)},
      {"maxLocalBatch", caps},
      {"recoverFromOutOfMemory", text(o.recoverFromOutOfMemory)},
      {"ddp.buckets", text(d.firstBucketBytes) + "/" + text(d.bucketCapBytes) + "/" +
                          text(d.rebuildBuckets) + "/" + text(d.allocateBucketsLazily)},
      {"ddp.findUnusedParameters", text(d.findUnusedParameters)},
      {"ddp.broadcastOnConstruction", text(d.broadcastOnConstruction)},
      {"ddp.bufferSync", text(static_cast<int>(d.bufferSync)) + "/" + text(d.bufferSyncInterval)},
      {"ddp.compression", text(static_cast<int>(d.compression))},
      // Each of them changes what a rank sends or the numbers it sends them with: which
      // gradients are factorised (minCompressionRate), the starting Qs (randomSeed), P's
      // orthogonalisation (epsilon).
      {"ddp.powerSgd", text(s.rank) + "/" + text(s.startStep) + "/" + text(s.errorFeedback) + "/" +
                           text(s.warmStart) + "/" + text(static_cast<int>(s.wireType)) + "/" +
                           text(s.minCompressionRate) + "/" + text(s.randomSeed) + "/" +
                           text(s.orthogonalizationEpsilon)},
      {"ddp.commHook", d.commHook ? "set" : "none"},
  };
}

void checkOptionsAgree(Communicator& comm, const TrainerOptions& o) {
  const auto mine = collectiveShapingOptions(o);
  std::string bytes;
  for (const auto& item : mine) {
    bytes += item.second;
    bytes.push_back('\0');
  }
  const auto all = comm.allgatherBytes(std::vector<uint8_t>(bytes.begin(), bytes.end()));
  // Each rank's values, split at the NULs (the names are the same in every build).
  std::vector<std::vector<std::string>> values;
  for (const auto& b : all) {
    std::vector<std::string> v(1);
    for (const uint8_t c : b) {
      if (c == 0) {
        v.emplace_back();
      } else {
        v.back().push_back(static_cast<char>(c));
      }
    }
    v.pop_back();
    values.push_back(std::move(v));
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    bool same = true;
    std::string byRank;
    for (size_t r = 0; r < values.size(); ++r) {
      HDDP_CHECK_AS(ConfigError, values[r].size() == mine.size(), "rank ", r, " sent ",
                    values[r].size(), " Trainer options where this rank has ", mine.size(),
                    ": every rank must run the same hddp build");
      same = same && values[r][i] == values[0][i];
      byRank += (r ? ", " : "") + std::string("rank ") + text(r) + ": " + values[r][i];
    }
    HDDP_CHECK_AS(ConfigError, same,
                  "the ranks were given different TrainerOptions::", mine[i].first, " (", byRank,
                  "); give every rank the same options (the same command line), or the ranks "
                  "would run different collectives and wait for each other until the timeout");
  }
}

}  // namespace train
}  // namespace hddp
