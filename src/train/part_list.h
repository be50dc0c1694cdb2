// The program's parts of the Trainer's loop (hddp/train/part.h) as the loop holds them:
// added and checked, their names agreed at fit()'s start, each hook called on every part
// with its exception kept, and their requests and failures made every rank's at the
// agreements (internal to the train layer).
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "hddp/train/part.h"

namespace hddp {
class Communicator;
namespace train {

class PartList {
 public:
  /// Trainer::addPart: refused during fit(), for a null part, a bad or a repeated name.
  void add(std::shared_ptr<TrainerPart> part);
  bool empty() const { return parts_.empty(); }
  std::vector<TrainerPart*> pointers() const;

  /// fit()'s start, before its resume: the parts' names agreed (one allgather; a second
  /// one to name the difference where they differ). Clears what a previous fit() left.
  void agreeNames(Communicator& comm);
  /// After the resume: every part's onFitStart, then an agreement (nothing without parts).
  void start(Communicator& comm, const FitStart& start, bool haveSaveFolder);

  /// Calls `hook` on every part in order; an exception is kept until agree().
  template <typename Hook>
  void each(Hook&& hook) {
    for (const auto& part : parts_) {
      try {
        hook(*part);
      } catch (...) {
        if (!failure_) {
          failure_ = std::current_exception();
          failureFrom_ = part->name();
        }
      }
    }
  }
  /// Where a hook writes this rank's requests until the next agreement.
  LoopRequests& requests() { return held_; }

  /// Every rank's requests and hook failures since the last agreement made everyone's
  /// (one 32-byte allreduce; nothing without parts): a failure throws on every rank, of
  /// its kind; a stop is kept (stopAsked()). Returns whether some rank asked to save
  /// (a ConfigError without a save folder). `step` is for the log.
  bool agree(Communicator& comm, int64_t step, bool haveSaveFolder);
  /// After a step: agreed now when some part asks for it (agreesEachStep), else at the
  /// epoch's end; saveAfterStep() says whether a save was asked for now.
  void afterStep(Communicator& comm, int64_t step, bool haveSaveFolder) {
    saveAfterStep_ = eachStep_ && agree(comm, step, haveSaveFolder);
  }
  bool saveAfterStep() const { return saveAfterStep_; }
  bool stopAsked() const { return stop_; }
  /// Why the run stops at a part's request (this rank's, or "on another rank").
  const std::string& stopWhy() const { return stopWhy_; }

  /// While fit() runs: add() refuses.
  class Fitting {
   public:
    explicit Fitting(PartList& list) : list_(list) { list_.fitting_ = true; }
    ~Fitting() { list_.fitting_ = false; }
    Fitting(const Fitting&) = delete;
    Fitting& operator=(const Fitting&) = delete;

   private:
    PartList& list_;
  };

 private:
  std::vector<std::shared_ptr<TrainerPart>> parts_;
  std::exception_ptr failure_;  // a hook's exception, until agree()
  std::string failureFrom_;     // the part that threw it
  LoopRequests held_;           // this rank's requests since the last agreement
  bool stop_ = false;           // a part asked to stop the run (agreed)
  std::string stopWhy_;
  bool eachStep_ = false;       // some part's agreesEachStep() (agreed)
  bool saveAfterStep_ = false;  // the last step's agreement asked to save
  bool fitting_ = false;
};

}  // namespace train
}  // namespace hddp
