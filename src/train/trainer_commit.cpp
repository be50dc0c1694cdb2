// A commit of the Trainer's (internal to the train layer): the state file, then its
// elastic part (train::ElasticRun::committed, elastic.h).
#include <torch/torch.h>

#include "train/trainer_impl.h"

namespace hddp {

void Trainer::Impl::commit(TrainSummary& summary) {
  summary.lastStateFile = saveMidEpoch();
  run_.lastSaved = step_;
  elastic_.committed(comm_, step_, summary.lastStateFile, run_.lastSaveStart);
}

}  // namespace hddp
