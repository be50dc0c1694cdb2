// GradCompression::Auto: the Trainer prices none, fp16 / bf16 and PowerSGD at ranks 4 and
// 1 over the job's slowest link against the backward they can hide behind
// (hddp/balance/compression_model.h), with PowerSGD's compute timed on every rank's
// device, and builds DDP with the choice. Every rank decides from the same exchanged
// figures, so every rank makes the same choice.
#include <torch/torch.h>

#include <algorithm>
#include <array>

#include "hddp/balance/seed.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/power_sgd.h"
#include "train/trainer_impl.h"

namespace hddp {

namespace {

CompressionSpec specOf(const DdpOptions& ddp) {
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
      s.factorBytes = static_cast<int>(c10::elementSize(ddp.powerSgd.wireType));
      break;
    default:
      break;
  }
  return s;
}

}  // namespace

std::string train::compressionName(const DdpOptions& ddp) {
  return ddp.commHook ? "hook" : specOf(ddp).name();
}

GradientLayout Trainer::Impl::gradientLayout() const {
  GradientLayout layout;
  for (const auto& p : uniqueParameters(*model_)) {
    if (p.requires_grad()) {
      layout.shapes.push_back(p.sizes().vec());
      layout.elementBytes = static_cast<int>(p.element_size());
    }
  }
  layout.firstBucketBytes = static_cast<double>(options_.ddp.firstBucketBytes);
  layout.bucketCapBytes = static_cast<double>(options_.ddp.bucketCapBytes);
  return layout;
}

void Trainer::Impl::resolveCompression(const std::vector<RankCost>& seed,
                                       const EmulationOptions& emulation) {
  const GradientLayout layout = gradientLayout();
  const AllreducePrediction slowest = hddp::predictAllreduce(seed, layout.bytes());
  LinkBudget link;
  link.ranks = comm_.size();
  link.bytesPerSecond = slowest.slowestLinkBytesPerSecond;
  link.latencySeconds = emulation.linkLatencySeconds;
  // The backward the buckets can hide behind: the slowest rank's at the first split.
  const BatchPlan plan = options_.balance ? solveSplit(seed, options_.globalBatch)
                                          : equalSplit(comm_.size(), options_.globalBatch);
  for (size_t r = 0; r < seed.size(); ++r) {
    link.backwardSeconds =
        std::max(link.backwardSeconds,
                 kBackwardShare * seed[r].secondsPerSample * static_cast<double>(plan.local[r]));
  }
  const std::vector<CompressionSpec> candidates = autoCandidates(options_.amp);
  // PowerSGD's compute on every rank's device; the slowest rank's counts.
  std::array<double, 4> mine{};
  for (size_t k = 0; k < candidates.size(); ++k) {
    if (candidates[k].kind == CompressionSpec::Kind::PowerSgd && link.ranks > 1) {
      PowerSgdOptions o = options_.ddp.powerSgd;
      o.rank = candidates[k].rank;
      mine[k] = timePowerSgdCompute(layout.shapes, o, device_);
    }
  }
  std::array<double, 4> compute{};
  for (const auto& theirs : allgatherValue(comm_, mine)) {
    for (size_t k = 0; k < compute.size(); ++k) {
      compute[k] = std::max(compute[k], theirs[k]);
    }
  }
  std::vector<CompressionCost> priced;
  for (size_t k = 0; k < candidates.size(); ++k) {
    CompressionSpec spec = candidates[k];
    if (spec.kind == CompressionSpec::Kind::PowerSgd) {
      spec.minCompressionRate = options_.ddp.powerSgd.minCompressionRate;
      spec.factorBytes = static_cast<int>(c10::elementSize(options_.ddp.powerSgd.wireType));
    }
    priced.push_back(priceCompression(compressionTraffic(spec, layout), layout, link, compute[k]));
  }
  const CompressionDecision d = chooseCompression(priced, link);
  switch (d.chosen.spec.kind) {
    case CompressionSpec::Kind::None:
      options_.ddp.compression = GradCompression::None;
      break;
    case CompressionSpec::Kind::Fp16:
      options_.ddp.compression = GradCompression::Fp16;
      break;
    case CompressionSpec::Kind::Bf16:
      options_.ddp.compression = GradCompression::Bf16;
      break;
    case CompressionSpec::Kind::PowerSgd:
      options_.ddp.compression = GradCompression::PowerSgd;
      options_.ddp.powerSgd.rank = d.chosen.spec.rank;
      break;
  }
  HDDP_LOG_SHARED(
      "ddp", comm_.rank(), "--compress auto chose ", d.why,
      d.chosen.spec.kind == CompressionSpec::Kind::PowerSgd
          ? "; PowerSGD starts at step " + std::to_string(options_.ddp.powerSgd.startStep)
          : std::string());
}

void Trainer::Impl::predictAllreduce(const std::vector<RankCost>& seed) {
  const GradientLayout layout = gradientLayout();
  const CompressionCost traffic = compressionTraffic(specOf(options_.ddp), layout);
  const AllreducePrediction p = hddp::predictAllreduce(seed, traffic.wireBytes);
  predictedAllreduceSeconds_ = p.seconds;
  if (predictedAllreduceSeconds_ > 0) {
    HDDP_LOG_SHARED("balance", comm_.rank(), "gradient allreduce: ", traffic.wireBytes / 1e6,
                    " MB (", traffic.spec.name(), ") over the slowest link (rank ", p.slowestRank,
                    ", ", p.slowestLinkBytesPerSecond / 1e9, " GB/s) takes ",
                    predictedAllreduceSeconds_ * 1e3,
                    " ms per step (ring model); no split changes it, backward hides part of it "
                    "(metrics: allreduce_predicted_s next to the measured comm_wait_s)");
  }
}

}  // namespace hddp
