// The mean loss over a step's whole global batch, from each rank's mean over its own
// share: what single-device training on the whole batch would report.
//
//   auto loss = torch::nll_loss(model.forward(x), y);      // mean over this rank's b_i
//   loss.backward();                                       // DDP weights it by b_i / B
//   double global = hddp::globalMeanLoss(comm, loss, x.size(0));  // for the log
//
// With unequal shares a plain average of the ranks' losses is wrong (a rank with 2
// samples would count as much as one with 200); the weights here are b_i / B.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hddp {

class Communicator;

/// sum_i b_i * loss_i / sum_i b_i over the ranks, where loss_i is rank i's mean loss over
/// its b_i = `localBatch` samples. A rank with no samples passes localBatch 0 and
/// contributes nothing (its loss may then be undefined, or NaN: the mean of nothing).
/// A collective: every rank calls it, in the same order as its other collectives (one
/// allreduce of two float64 numbers); blocks until the result is on the host. For
/// reporting: nothing is differentiated (backward goes through each rank's own mean).
/// NaN when no rank has a sample. Throws hddp::Error, before the collective, when
/// `localBatch` < 0 or the loss is a tensor that is not one number, whatever localBatch
/// (so that a loss of the wrong shape fails on every rank, the one without samples too),
/// or undefined on a rank with samples.
double globalMeanLoss(Communicator& comm, const at::Tensor& localMeanLoss, int64_t localBatch);
/// The same for a loss already on the host (e.g. a sum over an evaluation divided by
/// this rank's sample count).
double globalMeanLoss(Communicator& comm, double localMeanLoss, int64_t localBatch);

}  // namespace hddp
