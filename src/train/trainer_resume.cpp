// The Trainer's start of a run (internal to the train layer): what fit() resumes from,
// the given --resume or, on a launcher's restart or a new generation, the newest commit of
// the save folder; and the agreement on the folders that decides it.
#include <torch/torch.h>

#include <array>
#include <string>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/state_file.h"
#include "train/trainer_impl.h"

namespace hddp {

void Trainer::Impl::resumeForFit() {
  // The launcher's restart count, agreed: under torchrun's agent a node that joins counts
  // its own failures (none), the others theirs.
  const int restarts = static_cast<int>(reduceValues(
      comm_, std::array<double, 1>{static_cast<double>(elastic_.restarts())}, ReduceOp::Max)[0]);
  // Under torchrun's agent a generation that follows a membership change has no restart
  // to count: the job's own commits (its id in the file) say where it stands.
  const bool agentJob = elastic_.underAgent() && !elastic_.runId().empty();
  const std::string& resume = options_.resume;
  const bool resumeIsSaveDir = agreedFolders();
  budget_.start(step_);
  bool resumed = false;
  // On a restart or a new generation the newest commit of the save folder wins: `resume`
  // (--resume) only starts a run whose save folder holds no state yet, so work committed
  // since is never trained again.
  if (options_.resumeOnRestart && !options_.saveDir.empty() && (restarts > 0 || agentJob)) {
    // The same job's own commit: its time budget goes on (not a --resume of another run).
    run_.budgetCarry = options_.timeBudgetSeconds > 0;
    run_.restarted = true;
    train::LoadOptions newest;
    newest.keep = true;  // a folder without the commit keeps the copy it receives
    // Under the agent only this job's commits, whatever the count: a folder may hold
    // another job's (torchrun's ids tell them apart; hddp-run's restarts are its own).
    newest.onlyRunId = agentJob ? elastic_.runId() : std::string();
    resumed = load(options_.saveDir, newest);
    if (resumed) {
      HDDP_LOG_SHARED("train", comm_.rank(),
                      restarts > 0
                          ? "restart " + std::to_string(restarts) + " by the launcher"
                          : "a new generation of job '" + elastic_.runId() + "' (torchrun's agent)",
                      ": resumed from the newest commit in ", options_.saveDir,
                      resume.empty() || resumeIsSaveDir
                          ? std::string()
                          : " (not from " + resume + ", which only starts a run)");
    }
  }
  // --resume starts a run that found nothing of its own; the save folder given to it
  // counts whatever job wrote it (the user named it), unless it was just searched so.
  const bool searchedWhole = run_.restarted && !agentJob;
  if (!resumed && !resume.empty() && !(searchedWhole && resumeIsSaveDir)) {
    run_.budgetCarry = false;
    run_.restarted = restarts > 0;
    train::LoadOptions given;
    given.keep = resumeIsSaveDir;
    resumed = load(resume, given);
  }
  run_.budgetCarry = false;
  run_.restarted = false;
  if (restarts == 0 && !resumed && !resume.empty() && !resumeIsSaveDir &&
      !options_.saveDir.empty() && !listStateFiles(options_.saveDir).empty()) {
    HDDP_LOG_WARN("train", "the save folder ", options_.saveDir,
                  " already holds state files; this run starts from ", resume,
                  ", but a restart by the launcher resumes from the newest file there: move "
                  "older files away if they belong to another attempt");
  }
}

// Whether --resume names the save folder, agreed (collective): true only where it does
// on every rank. With a save folder per rank (--save-dir fold$RANK) `--resume fold0` is
// rank 0's own folder only, and a rank that decided alone would run other exchanges than
// the rest (docs/architecture.md, "Agreed decisions"). Whether each is given at all is
// the same on every rank (checked at construction: train/options_agreement.h).
bool Trainer::Impl::agreedFolders() {
  return agreeAll(comm_, !options_.resume.empty() && options_.resume == options_.saveDir);
}

}  // namespace hddp
