#include "hddp/comm/global_mean.h"

#include <ATen/ATen.h>

#include <array>
#include <limits>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"

namespace hddp {

double globalMeanLoss(Communicator& comm, const at::Tensor& localMeanLoss, int64_t localBatch) {
  HDDP_CHECK(localBatch >= 0, "globalMeanLoss: localBatch must be >= 0 (this rank's samples), got ",
             localBatch);
  // The same check whatever localBatch is, before the collective: a loss of the wrong
  // shape (say, reduction "none": one number per sample, none on a rank without samples)
  // throws on every rank, instead of on those with samples while a rank without waits
  // for them in the allreduce. Only a rank without samples may pass no loss at all.
  HDDP_CHECK((!localMeanLoss.defined() && localBatch == 0) ||
                 (localMeanLoss.defined() && localMeanLoss.numel() == 1),
             "globalMeanLoss: the local mean loss must be one number (the mean over this "
             "rank's ",
             localBatch,
             " samples, e.g. torch::nll_loss with its default mean reduction; on a rank without "
             "samples also undefined), got ",
             localMeanLoss.defined() ? c10::str("a tensor of shape ", localMeanLoss.sizes())
                                     : std::string("an undefined tensor"));
  if (localBatch == 0) {
    return globalMeanLoss(comm, 0.0, 0);
  }
  return globalMeanLoss(comm, localMeanLoss.detach().to(at::kDouble).item<double>(), localBatch);
}

double globalMeanLoss(Communicator& comm, double localMeanLoss, int64_t localBatch) {
  HDDP_CHECK(localBatch >= 0, "globalMeanLoss: localBatch must be >= 0 (this rank's samples), got ",
             localBatch);
  const double samples = static_cast<double>(localBatch);
  // A rank without samples adds 0, whatever its loss (NaN x 0 would be NaN).
  const double weighted = localBatch > 0 ? localMeanLoss * samples : 0.0;
  const auto sums = reduceValues(comm, std::array<double, 2>{weighted, samples});
  const double total = sums[1];
  return total > 0 ? sums[0] / total : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace hddp
