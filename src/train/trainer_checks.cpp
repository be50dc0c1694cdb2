// What the Trainer checks of what it is given before it builds anything, and the
// communicator its collectives go through (internal to the train layer).
#include "train/trainer_checks.h"

#include <torch/torch.h>

#include <set>

#include "hddp/comm/link_emulation.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/tensorboard.h"
#include "hddp/train/trainer.h"

namespace hddp {
namespace train {

void checkOptions(const TrainerOptions& o, const Dataset* train, const Communicator& comm,
                  const c10::Device& device) {
  HDDP_CHECK_AS(ConfigError, train != nullptr && train->size() > 0,
                "Trainer needs a non-empty training dataset");
  HDDP_CHECK_AS(ConfigError, o.globalBatch >= comm.size(), "global batch ", o.globalBatch,
                " is smaller than the number of ranks (", comm.size(), ")");
  HDDP_CHECK_AS(ConfigError, o.epochs >= 1 && o.maxSteps >= 0,
                "TrainerOptions: epochs must be >= 1 and maxSteps >= 0");
  if (o.ddp.compression == GradCompression::Auto) {
    HDDP_CHECK_AS(ConfigError, !o.ddp.commHook,
                  "DdpOptions: compression Auto and a commHook are both set; a hook of your own "
                  "decides what is sent, so leave compression at None");
    PowerSgdState validate(o.ddp.powerSgd);  // its options are checked now, not when chosen
  }
  HDDP_CHECK_AS(ConfigError, o.zero >= 0 && o.zero <= 2, "TrainerOptions::zero (--zero) is ",
                o.zero,
                "; give 0 (plain data parallelism), 1 (optimizer state sharded) or 2 "
                "(and gradients)");
  HDDP_CHECK_AS(ConfigError,
                o.zero == 0 || (!o.ddp.commHook && (o.ddp.compression == GradCompression::None ||
                                                    o.ddp.compression == GradCompression::Auto)),
                "ZeRO (--zero ", o.zero,
                ") reduces each gradient bucket to the rank that owns "
                "it and cannot be combined with gradient compression or a comm hook; drop "
                "--compress or use --zero 0");
  HDDP_CHECK_AS(ConfigError,
                o.zero == 0 || o.shardBy.kind != ShardBy::Kind::Ratios ||
                    static_cast<int>(o.shardBy.ratios.size()) == comm.size(),
                "--shard-by ", describeShardBy(o.shardBy), " gives ", o.shardBy.ratios.size(),
                " ratios for ", comm.size(), " ranks; give one per rank");
  HDDP_CHECK_AS(ConfigError, o.keepLast >= 1, "TrainerOptions::keepLast must be >= 1");
  HDDP_CHECK_AS(ConfigError, std::isfinite(o.timeBudgetSeconds) && o.timeBudgetSeconds >= 0,
                "TrainerOptions::timeBudgetSeconds (--time-budget) is ", o.timeBudgetSeconds,
                "; give the seconds the run may train, or 0 for no limit");
  HDDP_CHECK_AS(ConfigError, o.saveEvery == 0 || !o.saveDir.empty(),
                "saveEvery is set but saveDir is empty: say where state files go");
  HDDP_CHECK_AS(ConfigError, o.globalBatch <= train->size() || !o.loader.sampler.dropLast,
                "global batch ", o.globalBatch, " exceeds the dataset (", train->size(),
                " samples) with dropLast: no step would run");
  HDDP_CHECK_AS(ConfigError, comm.backend() != Backend::Nccl || device == comm.device(),
                "the model is on ", device.str(), " but this rank's NCCL communicator is bound to ",
                comm.device().str(),
                ": move the model to the rank's device (InitOptions::device, "
                "--device, HDDP_DEVICE)");
  HDDP_CHECK_AS(ConfigError, o.tensorboard.empty() || tensorBoardAvailable(),
                "TrainerOptions::tensorboard (--tensorboard) names the folder ", o.tensorboard,
                ", but this hddp was built without protobuf and cannot write TensorBoard event "
                "files. Install libprotobuf-dev and protobuf-compiler (scripts/setup.sh does) "
                "and build hddp again, or leave --tensorboard out");
  HDDP_CHECK_AS(ConfigError, o.amp != AmpMode::Fp16 || !device.is_cpu(),
                "fp16 mixed precision needs a GPU (this rank's model is on ", device.str(),
                "); on a CPU use bf16");
}

// An optimizer that lists one tensor twice (built from parameters() of a model with
// tied weights) would apply its update twice: refuse it, naming the tensor.
void checkOptimizerListsEachTensorOnce(torch::optim::Optimizer& optimizer,
                                       const torch::nn::Module& model) {
  std::set<const void*> seen;
  for (auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) {
        continue;
      }
      std::string name = "a parameter";
      for (const auto& item : model.named_parameters(/*recurse=*/true)) {
        if (item.value().unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) {
          name = "parameter '" + item.key() + "'";
          break;
        }
      }
      HDDP_THROW(ConfigError, "the optimizer lists ", name,
                 " twice (a weight tied under two names?), so each step would update it "
                 "twice. Build the optimizer from hddp::uniqueParameters(*model) instead of "
                 "model->parameters().");
    }
  }
}

// The communicator the Trainer's collectives go through: under an emulated slow link
// when the emulation asks for one (every rank computes the same link from the job's list).
std::unique_ptr<Communicator> emulatedLinkFor(Communicator& comm, const TrainerOptions& options) {
  const EmulationOptions e =
      options.emulation ? *options.emulation : emulationFromEnv(comm.rank(), comm.size());
  const LinkEmulation link{e.collectiveBytesPerSecond, e.linkLatencySeconds};
  if (!link.active() || comm.size() < 2) {
    return nullptr;
  }
  HDDP_LOG_SHARED("train", comm.rank(), "EMULATION ON: every collective of the Trainer takes ",
                  "the time of a ring over ",
                  link.bytesPerSecond > 0 ? c10::str(link.bytesPerSecond / 1e9, " GB/s")
                                          : std::string("an unlimited link"),
                  link.latencySeconds > 0
                      ? c10::str(" with ", link.latencySeconds * 1e6, " us per message")
                      : std::string(),
                  " (the slowest emulated link; docs/balance.md)");
  return emulateLink(comm, link);
}

}  // namespace train
}  // namespace hddp
