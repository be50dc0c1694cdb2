// Building the Trainer (internal to the train layer): its options resolved, checked and
// agreed, then DDP with the parts that decide around it: balancing's seed and planner,
// the compression choice, ZeRO.
#include <torch/torch.h>

#include <cstdint>
#include <utility>

#include "hddp/comm/exchange.h"
#include "hddp/core/autocast.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "train/options_agreement.h"
#include "train/trainer_checks.h"
#include "train/trainer_impl.h"

namespace hddp {
namespace {

// torchrun's agent starts new generations of ranks (a node left or joined, a rank
// failed): with a save folder they commit and resume as in hddp-run's elastic job.
void prepareUnderAgent(train::ElasticRun& elastic, const std::string& saveDir, int rank) {
  if (!saveDir.empty()) {
    elastic.commitForAgent(saveDir);
    if (elastic.runId().empty() && rank == 0) {
      HDDP_LOG_WARN("train",
                    "torchrun runs this job without a job id (--rdzv-id): a "
                    "generation it starts after a node joins cannot tell this job's commits "
                    "in ",
                    saveDir,
                    " from another job's, so it resumes them only "
                    "with --resume. Give --rdzv-id");
    }
  } else if (rank == 0) {
    HDDP_LOG_WARN("train", "torchrun's agent runs this job (id '", elastic.runId(),
                  "') but no save folder is given: a generation it starts after a node "
                  "leaves or joins, or after a failure, trains from step 0. Give saveDir "
                  "(--save-dir) to commit and resume");
  }
}

}  // namespace

void Trainer::Impl::resolveAndAgreeOptions(Communicator& comm, const Dataset* train) {
  // The given communicator, as before any emulated link: these few exchanges decide the
  // options, not the training's timing.
  // A rank's own problem with its options (its device, its data) fails every rank at once;
  // then every rank must have been given the options that shape the collectives alike.
  for (const auto& module : model_->modules(/*include_self=*/true)) {
    hasSyncBatchNorm_ = hasSyncBatchNorm_ || dynamic_cast<SyncBatchNormImpl*>(module.get());
  }
  ResolvedOptions resolved;
  agreeOutcome<ConfigError>(comm, "checking the Trainer's options", [&] {
    RankFacts facts;
    facts.device = device_;
    facts.elasticDir = elastic_.enabled() ? elastic_.dir() : std::string();
    facts.hasSyncBatchNorm = hasSyncBatchNorm_;
    if (given_.amp == AmpMode::Bf16) {
      facts.bf16Fallback = env::resolveBool("HDDP_BF16_FALLBACK", given_.bf16Fallback).value;
      if (facts.bf16Fallback) {
        const Bf16Support bf16 = bf16Support(device_);
        facts.bf16Native = bf16.native;
        facts.bf16Why = bf16.why;
      }
    }
    resolved = resolveOptions(given_, facts);
    train::checkOptions(resolved.options, train, comm, device_);
  });
  options_ = std::move(resolved.options);
  const int rank = comm.rank();
  for (const auto& note : resolved.notes) {
    if (note.warn) {
      HDDP_LOG_WARN("train", "rank ", rank, " ", note.text);
    } else if (note.everyRank) {
      HDDP_LOG_INFO("train", "rank ", rank, " ", note.text);
    } else {
      HDDP_LOG_SHARED("train", rank, note.text);
    }
  }
  train::checkOptionsAgree(comm, options_);
  if (elastic_.underAgent()) {
    prepareUnderAgent(elastic_, options_.saveDir, rank);
  }
  // Elastic commits and a launcher's restarts decide exchanges too (fit()'s start, the
  // commits): every rank must see the same launcher.
  const uint8_t elastic = (elastic_.enabled() ? 1 : 0) | (elastic_.underAgent() ? 2 : 0);
  for (const uint8_t other : allgatherValue<uint8_t>(comm, elastic)) {
    HDDP_CHECK_AS(ConfigError, other == elastic,
                  "the ranks were not started alike: some run as an elastic job (hddp-run "
                  "--elastic, or torchrun's agent) and some do not; start every rank with the "
                  "same launcher and settings");
  }
}

void Trainer::Impl::buildDdpAndBalancing(const Dataset& train) {
  const int rank = comm_.rank();
  const EmulationOptions emulation =
      options_.emulation ? *options_.emulation : emulationFromEnv(rank, comm_.size());
  balance_ = std::make_unique<train::Balancing>(comm_, device_, options_, emulation);
  // GradCompression::Auto: DDP starts with the plain allreduce and is switched before
  // its first step, once it has checked that the ranks' models agree and the seed has
  // timed them.
  const bool autoCompress = options_.ddp.compression == GradCompression::Auto;
  DdpOptions ddpOptions = options_.ddp;
  if (options_.zero > 0) {
    ddpOptions.allocateBucketsLazily = true;  // a rank keeps its own buckets only
  }
  if (autoCompress) {
    ddpOptions.compression = GradCompression::None;
  }
  if (emulation.slowdown != 1.0) {
    // An emulated slower card sends each bucket when it would have computed it: its
    // stretched backward overlaps the allreduce as a real one does.
    ddpOptions.beforeBucketLaunch = [this,
                                     user = std::move(ddpOptions.beforeBucketLaunch)](int bucket) {
      balance_->emulator().beforeBucketLaunch(bucket);
      if (user) {
        user(bucket);
      }
    };
  }
  ddp_ = std::make_unique<DistributedDataParallel>(model_, comm_, ddpOptions);
  const bool seeded = options_.balance && options_.seedPlan;
  if (seeded || autoCompress) {
    balance_->measureSeed(*model_, forward_, train, options_);
  }
  if (autoCompress) {
    compression_.choose(comm_, device_, balance_->seed(),
                        train::gradientLayoutOf(*model_, options_.ddp), options_,
                        emulation.linkLatencySeconds);
    ddp_->setCompression(options_.ddp.compression, options_.ddp.powerSgd);
  } else {
    compression_ = train::CompressionChoice(options_.ddp);
  }
  if (options_.zero > 0) {
    shardOptimizer();
  }
  if (seeded) {
    compression_.predict(rank, balance_->seed(), train::gradientLayoutOf(*model_, options_.ddp),
                         options_.ddp);
  }
  balance_->start(options_);  // the planner, the given memory caps, the step timer
}

void Trainer::Impl::adoptCompression(const std::string& name) {
  if (compression_.adopt(name, options_.ddp) && !balance_->seed().empty()) {
    // allreduce_predicted_s for what is sent now
    compression_.predict(comm_.rank(), balance_->seed(),
                         train::gradientLayoutOf(*model_, options_.ddp), options_.ddp);
  }
}

}  // namespace hddp
