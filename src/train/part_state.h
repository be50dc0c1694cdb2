// The Trainer's parts in its state files (internal to the train layer): each part with a
// state (TrainerPart::stateVersion() > 0) under its name, rank 0's, read back on every
// rank (hddp/train/part.h says what a part may expect).
//
// In rank 0's part of the state file (`rank0`, trainer_state.h), so that every writer of
// a commit writes rank 0's states and the commit id covers them, the archive
// `trainer_parts` (absent when no part has a state):
//   names            the parts' names, one per line, as bytes
//   state_<name>     the part's saveState() bytes
//   version_<name>   its stateVersion() (int64)
// or, when a part failed to give its state, `trainer_parts_error` (its message as bytes):
// the writers then fail the save on every rank.
#pragma once

#include <string>
#include <vector>

#include "train/state_archive.h"

namespace hddp {

class TrainerPart;

namespace train {

/// Writes the parts that have a state into `archive` (nothing when none has one); when a
/// part's stateVersion() or saveState() throws (running out of memory too), its message
/// instead: it throws nothing itself.
/// Returns false when it wrote the message.
bool writePartStatesOrError(OutputArchive& archive, const std::vector<TrainerPart*>& parts);
/// A writer, before it writes the file: throws the StateError a part's failure on rank 0
/// left in rank 0's part (`rank0Blob`, its bytes).
void checkPartStatesSaved(const std::vector<uint8_t>& rank0Blob);

/// A part's state as a file holds it.
struct SavedPartState {
  TrainerPart* part = nullptr;
  std::string bytes;
  int version = 0;
};

/// The file's state of each of `parts`, read and checked before anything changes: a
/// damaged entry or a version newer than the part's is a StateError naming `path`. A
/// part the file has no state for is left out (the log says it keeps its own), and so
/// is a part of the file that this program does not have (the log names it); `log`: say
/// so here (one rank says it for all).
std::vector<SavedPartState> readPartStates(InputArchive& archive,
                                           const std::vector<TrainerPart*>& parts,
                                           const std::string& path, bool log);

/// Each part's state now (saveState()), to put back with restorePartStates.
std::vector<std::string> partStatesNow(const std::vector<SavedPartState>& saved);
/// Loads each saved state into its part, in order; a part's refusal is a StateError
/// naming it (running out of memory passes as it is).
void applyPartStates(const std::vector<SavedPartState>& saved);
/// Puts back what partStatesNow() returned (after a load that failed on some rank); a
/// part that refuses its own state is logged and left as it is.
void restorePartStates(const std::vector<SavedPartState>& saved,
                       const std::vector<std::string>& before);

}  // namespace train
}  // namespace hddp
