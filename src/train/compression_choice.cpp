// The compression choice (train/compression_choice.h). GradCompression::Auto prices none,
// fp16 / bf16 and PowerSGD at ranks 4 and 1 over the job's slowest link against the
// backward they can hide behind (hddp/balance/compression_model.h), with PowerSGD's
// compute timed on every rank's device; the Trainer switches DDP to the choice. Every
// rank decides from the same exchanged figures, so every rank makes the same choice.
#include "train/compression_choice.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "hddp/balance/seed.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/power_sgd.h"
#include "train/trainer_state.h"

namespace hddp::train {

namespace {

// `gradientBytes`: the size of one gradient element (PowerSGD's factors travel in the
// gradients' type unless its options name another).
CompressionSpec specOf(const DdpOptions& ddp, int gradientBytes = 4) {
  CompressionSpec s;
  switch (ddp.compression) {
    case GradCompression::Fp16:
      s.kind = CompressionSpec::Kind::Fp16;
      break;
    case GradCompression::Bf16:
      s.kind = CompressionSpec::Kind::Bf16;
      break;
    case GradCompression::PowerSgd:
      s.kind = CompressionSpec::Kind::PowerSgd;
      s.rank = ddp.powerSgd.rank;
      s.minCompressionRate = ddp.powerSgd.minCompressionRate;
      s.factorBytes = ddp.powerSgd.wireType == c10::ScalarType::Undefined
                          ? gradientBytes
                          : static_cast<int>(c10::elementSize(ddp.powerSgd.wireType));
      break;
    default:
      break;
  }
  return s;
}

}  // namespace

GradCompression gradCompressionOf(const CompressionSpec& spec) {
  switch (spec.kind) {
    case CompressionSpec::Kind::Fp16:
      return GradCompression::Fp16;
    case CompressionSpec::Kind::Bf16:
      return GradCompression::Bf16;
    case CompressionSpec::Kind::PowerSgd:
      return GradCompression::PowerSgd;
    case CompressionSpec::Kind::None:
      break;
  }
  return GradCompression::None;
}

std::string compressionName(const DdpOptions& ddp) {
  return ddp.commHook ? "hook" : specOf(ddp).name();
}

GradientLayout gradientLayoutOf(torch::nn::Module& model, const DdpOptions& ddp) {
  GradientLayout layout;
  for (const auto& p : uniqueParameters(model)) {
    if (p.requires_grad()) {
      layout.shapes.push_back(p.sizes().vec());
      layout.elementBytes = static_cast<int>(p.element_size());
    }
  }
  layout.firstBucketBytes = static_cast<double>(ddp.firstBucketBytes);
  layout.bucketCapBytes = static_cast<double>(ddp.bucketCapBytes);
  return layout;
}

void CompressionChoice::choose(Communicator& comm, c10::Device device,
                               const std::vector<RankCost>& seed, const GradientLayout& layout,
                               TrainerOptions& options, double linkLatencySeconds) {
  const AllreducePrediction slowest = hddp::predictAllreduce(seed, layout.bytes());
  // What each rank adds to the seed: its PowerSGD compute at ranks 4 and 1 (NaN: the
  // timing failed there), whether it computes in bf16, and its emulated latency. Every
  // rank then decides from the same figures.
  constexpr size_t kPowerSgdRanks = 2;
  const int powerSgdRanks[kPowerSgdRanks] = {4, 1};
  std::array<double, kPowerSgdRanks + 2> mine{};
  for (size_t k = 0; k < kPowerSgdRanks; ++k) {
    if (comm.size() == 1) {
      continue;  // nothing is sent
    }
    PowerSgdOptions o = options.ddp.powerSgd;
    o.rank = powerSgdRanks[k];
    try {
      mine[k] = timePowerSgdCompute(layout.shapes, o, device);
    } catch (const std::exception& e) {
      // Told to every rank through the exchange below, so that none waits for this one.
      mine[k] = std::numeric_limits<double>::quiet_NaN();
      HDDP_LOG_WARN("ddp", "rank ", comm.rank(), ": timing PowerSGD at rank ", powerSgdRanks[k],
                    " on ", device.str(), " failed (", e.what(),
                    "): --compress auto leaves PowerSGD out");
    }
  }
  mine[kPowerSgdRanks] = options.amp == AmpMode::Bf16 ? 1.0 : 0.0;
  mine[kPowerSgdRanks + 1] = linkLatencySeconds;
  std::array<double, kPowerSgdRanks + 2> all{};
  all[kPowerSgdRanks] = 1.0;
  for (const auto& theirs : allgatherValue(comm, mine)) {
    for (size_t k = 0; k < kPowerSgdRanks; ++k) {
      all[k] = std::isnan(theirs[k]) || std::isnan(all[k]) ? theirs[k] + all[k]
                                                           : std::max(all[k], theirs[k]);
    }
    all[kPowerSgdRanks] = std::min(all[kPowerSgdRanks], theirs[kPowerSgdRanks]);
    all[kPowerSgdRanks + 1] = std::max(all[kPowerSgdRanks + 1], theirs[kPowerSgdRanks + 1]);
  }
  LinkBudget link;
  link.ranks = comm.size();
  link.bytesPerSecond = slowest.slowestLinkBytesPerSecond;
  link.latencySeconds = all[kPowerSgdRanks + 1];
  // The backward the buckets can hide behind: the slowest rank's at the first split
  // (the planner's from the seed, else the equal split).
  const BatchPlan plan = options.balance && options.seedPlan
                             ? solveSplit(seed, options.globalBatch)
                             : equalSplit(comm.size(), options.globalBatch);
  for (size_t r = 0; r < seed.size(); ++r) {
    link.backwardSeconds =
        std::max(link.backwardSeconds,
                 kBackwardShare * seed[r].secondsPerSample * static_cast<double>(plan.local[r]));
  }
  // bf16 only where every rank computes in it (a mixed job sends fp16: one type for all).
  std::vector<CompressionCost> candidates;
  std::string left;
  for (CompressionSpec spec :
       autoCandidates(all[kPowerSgdRanks] > 0 ? AmpMode::Bf16 : AmpMode::Off)) {
    double compute = 0.0;
    if (spec.kind == CompressionSpec::Kind::PowerSgd) {
      const size_t k = spec.rank == powerSgdRanks[0] ? 0 : 1;
      if (std::isnan(all[k])) {
        left += (left.empty() ? "" : ", ") + spec.name();
        continue;
      }
      compute = all[k];
      spec.minCompressionRate = options.ddp.powerSgd.minCompressionRate;
      const c10::ScalarType wire = options.ddp.powerSgd.wireType;
      spec.factorBytes = wire == c10::ScalarType::Undefined
                             ? layout.elementBytes  // the gradients' own type
                             : static_cast<int>(c10::elementSize(wire));
    }
    candidates.push_back(priceCompression(compressionTraffic(spec, layout), layout, link, compute));
  }
  const CompressionDecision d = chooseCompression(candidates, link);
  options.ddp.compression = train::gradCompressionOf(d.chosen.spec);
  if (options.ddp.compression == GradCompression::PowerSgd) {
    options.ddp.powerSgd.rank = d.chosen.spec.rank;
  }
  // The same figures give the same choice; a rank of another build could still differ.
  const auto choices = allgatherValue(
      comm, static_cast<int32_t>(static_cast<int>(d.chosen.spec.kind) * 1000 + d.chosen.spec.rank));
  for (size_t r = 1; r < choices.size(); ++r) {
    HDDP_CHECK(choices[r] == choices[0], "--compress auto: rank ", r,
               " chose otherwise than rank 0 from the same figures; every rank must run the "
               "same hddp build");
  }
  name_ = compressionName(options.ddp);
  chosen_ = true;
  HDDP_LOG_SHARED(
      "ddp", comm.rank(), "--compress auto chose ", d.why,
      left.empty() ? std::string() : "; left out (timing failed): " + left,
      d.chosen.spec.kind == CompressionSpec::Kind::PowerSgd
          ? "; PowerSGD starts at step " + std::to_string(options.ddp.powerSgd.startStep)
          : std::string());
}

bool CompressionChoice::adopt(const std::string& name, DdpOptions& ddp) {
  if (name.empty() || name == name_) {
    return false;
  }
  name_ = name;
  if (name == "hook") {
    return false;
  }
  const CompressionSpec spec = CompressionSpec::parse(name, "the state file's compression");
  ddp.compression = gradCompressionOf(spec);
  if (ddp.compression == GradCompression::PowerSgd) {
    ddp.powerSgd.rank = spec.rank;
  }
  return true;
}

void CompressionChoice::predict(int rank, const std::vector<RankCost>& seed,
                                const GradientLayout& layout, const DdpOptions& ddp) {
  const CompressionCost traffic = compressionTraffic(specOf(ddp, layout.elementBytes), layout);
  const AllreducePrediction p = hddp::predictAllreduce(seed, traffic.wireBytes);
  predicted_ = p.seconds;
  predictedPlain_ = hddp::predictAllreduce(seed, layout.bytes()).seconds;
  if (predicted_ > 0) {
    HDDP_LOG_SHARED("balance", rank, "gradient allreduce: ", traffic.wireBytes / 1e6, " MB (",
                    name_.empty() ? traffic.spec.name() : name_, ") over the slowest link (rank ",
                    p.slowestRank, ", ", p.slowestLinkBytesPerSecond / 1e9, " GB/s) takes ",
                    predicted_ * 1e3,
                    " ms per step (ring model); no split changes it, backward hides part of it "
                    "(metrics: allreduce_predicted_s next to the measured comm_wait_s)");
  }
}

}  // namespace hddp::train
