// The Trainer's parts in its state files (train/part_state.h).
#include "train/part_state.h"

#include <torch/torch.h>

#include <set>
#include <sstream>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/part.h"

namespace hddp {
namespace train {
namespace {

constexpr const char* kEntry = "trainer_parts";
constexpr const char* kError = "trainer_parts_error";

std::string bytesOf(InputArchive& archive, const std::string& key, const std::string& path) {
  const at::Tensor t = readTensor(archive, key, path);
  HDDP_CHECK_AS(StateError, t.scalar_type() == at::kByte && t.dim() == 1, "state file ", path,
                ": its entry ", kEntry, "/", key,
                " is not bytes; resume from an earlier state file");
  return tensorBytes(t);
}

}  // namespace

bool writePartStatesOrError(OutputArchive& archive, const std::vector<TrainerPart*>& parts) {
  OutputArchive out;
  std::string names;
  try {
    for (TrainerPart* part : parts) {
      const int version = part->stateVersion();
      if (version <= 0) {
        continue;
      }
      const std::string name = part->name();
      const std::string bytes = part->saveState();
      names += name + "\n";
      out.write("state_" + name, bytesTensor(std::vector<uint8_t>(bytes.begin(), bytes.end())));
      out.write("version_" + name, at::tensor(static_cast<int64_t>(version)));
    }
  } catch (...) {
    // Whatever it is, running out of memory too: rank 0 is before the ranks' allgather
    // here, and the writers' agreement fails every rank with it (part_state.h).
    const std::string why =
        "a part of the Trainer could not give its state on rank 0: " + currentFailure().message;
    archive.write(kError, bytesTensor(std::vector<uint8_t>(why.begin(), why.end())));
    return false;
  }
  if (!names.empty()) {
    out.write("names", bytesTensor(std::vector<uint8_t>(names.begin(), names.end())));
    archive.write(kEntry, out);
  }
  return true;
}

void checkPartStatesSaved(const std::vector<uint8_t>& rank0Blob) {
  InputArchive blob;
  loadArchive(blob, std::string(rank0Blob.begin(), rank0Blob.end()), "rank 0's part",
              c10::Device(c10::kCPU));
  at::Tensor error;
  if (blob.try_read(kError, error)) {
    HDDP_THROW(StateError, tensorBytes(error));
  }
}

std::vector<SavedPartState> readPartStates(InputArchive& archive,
                                           const std::vector<TrainerPart*>& parts,
                                           const std::string& path, bool log) {
  std::vector<SavedPartState> saved;
  InputArchive in;
  std::set<std::string> inFile;
  if (archive.try_read(kEntry, in)) {
    std::istringstream lines(bytesOf(in, "names", path));
    for (std::string name; std::getline(lines, name);) {
      inFile.insert(name);
    }
  }
  std::set<std::string> ours;
  for (TrainerPart* part : parts) {
    const std::string name = part->name();
    ours.insert(name);
    const int version = part->stateVersion();
    if (version <= 0) {
      continue;
    }
    if (inFile.count(name) == 0) {
      if (log) {
        HDDP_LOG_WARN("train", path, " holds no state of the part '", name,
                      "' (saved before it was added?): the part keeps its own");
      }
      continue;
    }
    const at::Tensor v = readTensor(in, "version_" + name, path);
    HDDP_CHECK_AS(StateError, v.scalar_type() == at::kLong && v.numel() == 1, "state file ", path,
                  ": the part '", name,
                  "' has no readable version; resume from an earlier state "
                  "file");
    const int64_t fileVersion = v.item<int64_t>();
    HDDP_CHECK_AS(StateError, fileVersion >= 1 && fileVersion <= version, "state file ", path,
                  " holds the part '", name, "' at version ", fileVersion,
                  ", which this program's part (version ", version,
                  ") cannot read: load it with the program that saved it, or one newer");
    saved.push_back({part, bytesOf(in, "state_" + name, path), static_cast<int>(fileVersion)});
  }
  if (log) {
    for (const auto& name : inFile) {
      if (ours.count(name) == 0) {
        HDDP_LOG_WARN("train", path, " holds the state of a part '", name,
                      "' that this program does not have: it goes unused");
      }
    }
  }
  return saved;
}

std::vector<std::string> partStatesNow(const std::vector<SavedPartState>& saved) {
  std::vector<std::string> now;
  for (const auto& s : saved) {
    now.push_back(s.part->saveState());
  }
  return now;
}

void applyPartStates(const std::vector<SavedPartState>& saved) {
  for (const auto& s : saved) {
    try {
      s.part->loadState(s.bytes, s.version);
    } catch (...) {
      // Of one kind on every rank (the load's agreement keeps a StateError's kind): the
      // part refused what the file holds for it.
      rethrowIfOutOfMemory();
      HDDP_THROW(StateError, "the part '", s.part->name(), "' refused its state (version ",
                 s.version, "): ", currentFailure().message);
    }
  }
}

void restorePartStates(const std::vector<SavedPartState>& saved,
                       const std::vector<std::string>& before) {
  for (size_t i = 0; i < saved.size() && i < before.size(); ++i) {
    try {
      saved[i].part->loadState(before[i], saved[i].part->stateVersion());
    } catch (const std::exception& e) {
      HDDP_LOG_ERROR("train", "the part '", saved[i].part->name(),
                     "' refused its own state when put back after a failed load: ", e.what());
    }
  }
}

}  // namespace train
}  // namespace hddp
