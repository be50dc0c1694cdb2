// The program's parts of the Trainer's loop as the loop holds them (train/part_list.h):
// adding them, their names agreed at fit()'s start, and their requests and failures
// agreed after each phase that may make them.
#include "train/part_list.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cctype>

#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/state_file.h"

namespace hddp::train {

void PartList::add(std::shared_ptr<TrainerPart> part) {
  HDDP_CHECK_AS(ConfigError, !fitting_, "Trainer::addPart: called during fit(); add parts before");
  HDDP_CHECK_AS(ConfigError, part != nullptr, "Trainer::addPart: the part is null");
  const std::string name = part->name();
  bool valid = !name.empty() && name.size() <= 64;
  for (const char c : name) {
    valid = valid && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-');
  }
  HDDP_CHECK_AS(ConfigError, valid, "Trainer::addPart: the part's name '", name,
                "' must be 1 to 64 letters, digits, '_' or '-' (it names its state in state "
                "files)");
  for (const auto& other : parts_) {
    HDDP_CHECK_AS(ConfigError, other->name() != name, "Trainer::addPart: a part named '", name,
                  "' was added already; give each part a name of its own");
  }
  parts_.push_back(std::move(part));
}

std::vector<TrainerPart*> PartList::pointers() const {
  std::vector<TrainerPart*> out;
  for (const auto& part : parts_) {
    out.push_back(part.get());
  }
  return out;
}

void PartList::agreeNames(Communicator& comm) {
  failure_ = nullptr;
  held_ = LoopRequests{};
  stop_ = false;
  stopWhy_.clear();
  saveAfterStep_ = false;
  // The parts decide collectives (the agreements after steps and epochs): every rank must
  // have the same ones, by name and order, and agree each step or not alike. One
  // collective (the count, a checksum of the names, the per-step flag); only where they
  // differ, a second one for the names themselves, to say which.
  std::string names;
  bool eachStep = false;
  for (const auto& part : parts_) {
    names += part->name() + (part->agreesEachStep() ? " (agreed each step)\n" : "\n");
    eachStep = eachStep || part->agreesEachStep();
  }
  const std::array<uint32_t, 3> mine{static_cast<uint32_t>(parts_.size()),
                                     crc32Of(names.data(), names.size()), eachStep ? 1u : 0u};
  const auto all = allgatherValue(comm, mine);
  if (std::any_of(all.begin(), all.end(), [&](const auto& other) { return other != all[0]; })) {
    const auto text = comm.allgatherBytes(std::vector<uint8_t>(names.begin(), names.end()));
    for (size_t r = 1; r < text.size(); ++r) {
      HDDP_CHECK_AS(ConfigError, all[r] == all[0],
                    "the Trainer's parts differ between ranks: ", "rank 0 has [",
                    std::string(text[0].begin(), text[0].end()), "], rank ", r, " has [",
                    std::string(text[r].begin(), text[r].end()),
                    "] (one name per line). Add the same parts in the same order on every rank");
    }
  }
  eachStep_ = eachStep;
}

void PartList::start(Communicator& comm, const FitStart& start, bool haveSaveFolder) {
  if (parts_.empty()) {
    return;
  }
  each([&](TrainerPart& part) { part.onFitStart(comm, start); });
  agree(comm, start.step, haveSaveFolder);
}

bool PartList::agree(Communicator& comm, int64_t step, bool haveSaveFolder) {
  if (parts_.empty()) {
    return false;
  }
  const LoopRequests requests = held_;
  held_ = LoopRequests{};
  RankOutcome failure;
  if (failure_) {
    try {
      std::rethrow_exception(failure_);
    } catch (...) {
      failure = currentFailure();
    }
  }
  const auto agreed = reduceValues(
      comm,
      std::array<double, 4>{requests.stopAsked() ? 1.0 : 0.0, requests.saveAsked() ? 1.0 : 0.0,
                            failure_ ? static_cast<double>(comm.rank() + 1) : 0.0,
                            static_cast<double>(failure.failure)},
      ReduceOp::Max);
  if (failure_) {
    HDDP_LOG_ERROR("train", "rank ", comm.rank(), ": the part '", failureFrom_,
                   "' failed: ", failure.message);
    std::exception_ptr mine = failure_;
    failure_ = nullptr;
    std::rethrow_exception(mine);
  }
  if (agreed[2] != 0) {  // of the kind the failing rank met: every rank fails alike
    throwAs(static_cast<FailureKind>(static_cast<int>(agreed[3])),
            c10::str("a part of the Trainer failed on rank ", static_cast<int>(agreed[2]) - 1,
                     " (its log says which and why); every rank stops"));
  }
  if (requests.stopAsked()) {
    HDDP_LOG_INFO("train", "rank ", comm.rank(), ": a part asks to end the run at step ", step,
                  ": ", requests.why());
  }
  if (agreed[0] != 0 && !stop_) {
    stop_ = true;
    stopWhy_ = requests.stopAsked() ? requests.why() : "a part's request on another rank";
    HDDP_LOG_SHARED("train", comm.rank(), "the run ends at step ", step, " at a part's request");
  }
  HDDP_CHECK_AS(ConfigError, agreed[1] == 0 || haveSaveFolder,
                "a part of the Trainer asked to save at step ", step,
                ", but there is no save folder: set TrainerOptions::saveDir (--save-dir)");
  return agreed[1] != 0;
}

}  // namespace hddp::train
