// The options as the Trainer runs them (resolveOptions, hddp/train/trainer.h): a pure
// function of the options given and the rank's facts.
#include <c10/util/StringUtil.h>

#include <algorithm>

#include "hddp/train/trainer.h"

namespace hddp {

ResolvedOptions resolveOptions(TrainerOptions given, const RankFacts& facts) {
  ResolvedOptions out;
  TrainerOptions& o = given;
  if (!facts.elasticDir.empty() && o.saveDir.empty()) {
    o.saveDir = facts.elasticDir;  // commits go where the launcher says (hddp-run)
  }
  if (o.amp == AmpMode::Bf16 && facts.bf16Fallback) {
    if (!facts.bf16Native) {
      // Emulated bf16 is slower than float32 (11x for ResNet-20 on an AVX2 CPU), and the
      // point of bf16 is speed: train in float32 and say so.
      o.amp = AmpMode::Off;
      out.notes.push_back(
          {true, true,
           c10::str("on ", facts.device.str(), ": bf16 asked for, but ", facts.bf16Why,
                    ": bf16 would be emulated (slower than float32), so "
                    "this rank trains in float32 (HDDP_BF16_FALLBACK=0 "
                    "keeps bf16)")});
    } else {
      out.notes.push_back(
          {false, true,
           c10::str("on ", facts.device.str(), ": bf16 natively (", facts.bf16Why, ")")});
    }
  }
  if (o.zero > 0 && o.ddp.compression == GradCompression::Auto) {
    o.ddp.compression = GradCompression::None;  // buckets go to their owners whole
    out.notes.push_back({false, false,
                         c10::str("ZeRO-", o.zero,
                                  ": gradient compression is off (each bucket is "
                                  "reduced to its owner)")});
  }
  if (facts.hasSyncBatchNorm && o.planner.minLocalBatch < 1) {
    // SyncBatchNorm's collectives run in forward: a rank without samples would skip them
    // while the others wait. Every rank keeps at least one sample in every step.
    o.planner.minLocalBatch = 1;
    out.notes.push_back(
        {false, false, "SyncBatchNorm: every rank gets at least one sample per step"});
  }
  LoaderOptions& lo = o.loader;
  lo.device = facts.device;
  lo.seed = o.seed;
  lo.sampler.seed = o.seed;
  lo.sampler.minLocalBatch = std::max(lo.sampler.minLocalBatch, o.planner.minLocalBatch);
  out.options = std::move(given);
  return out;
}

}  // namespace hddp
