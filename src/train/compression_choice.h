// The compression choice, the Trainer's part that decides what DDP sends for the
// gradients (internal to the train layer): GradCompression::Auto priced over the job's
// slowest link against the backward it can hide behind (hddp/balance/compression_model.h),
// the choice a state file brings back, and the allreduce's predicted time per step for
// the metrics. Every rank decides from the same exchanged figures.
#pragma once

#include <string>
#include <vector>

#include "hddp/balance/compression_model.h"
#include "hddp/balance/cost_model.h"
#include "hddp/train/trainer.h"

namespace hddp::train {

/// What `ddp` sends for the gradients: "none", "fp16", "bf16", "powersgd:R", "hook".
std::string compressionName(const DdpOptions& ddp);
/// The gradients DDP reduces: `model`'s parameters with gradients, `ddp`'s buckets.
GradientLayout gradientLayoutOf(torch::nn::Module& model, const DdpOptions& ddp);

class CompressionChoice {
 public:
  CompressionChoice() = default;
  /// What `ddp` sends as given (not Auto).
  explicit CompressionChoice(const DdpOptions& ddp) : name_(compressionName(ddp)) {}

  /// GradCompression::Auto: prices none, fp16 / bf16 and PowerSGD at ranks 4 and 1 (its
  /// compute timed on every rank's device), writes the choice into options.ddp and logs
  /// why (collective: two allgathers).
  void choose(Communicator& comm, c10::Device device, const std::vector<RankCost>& seed,
              const GradientLayout& layout, TrainerOptions& options, double linkLatencySeconds);
  /// A state file's compression (`name`; empty: none) that its load put in place of
  /// this run's choice: `ddp` follows it. False when nothing changed.
  bool adopt(const std::string& name, DdpOptions& ddp);
  /// The gradients' ring allreduce over the slowest rank's link for what `ddp` sends,
  /// and for the plain gradients (PowerSGD's steps before its start), logged.
  void predict(int rank, const std::vector<RankCost>& seed, const GradientLayout& layout,
               const DdpOptions& ddp);
  /// The prediction for this step (0: not predicted).
  double predictedSeconds(bool compressing) const {
    return compressing ? predicted_ : predictedPlain_;
  }
  /// "none", "fp16", "powersgd:4", "hook" (the metrics' config, the state file's entry).
  const std::string& name() const { return name_; }
  /// Auto chose it (a resume then adopts a state file's choice).
  bool chosen() const { return chosen_; }

 private:
  std::string name_;
  bool chosen_ = false;
  double predicted_ = 0;
  double predictedPlain_ = 0;
};

}  // namespace hddp::train
