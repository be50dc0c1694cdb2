// Commit folders that not every rank shares (internal to the train layer).
//
// A job across nodes may give each node its own --save-dir (a local disk, no shared file
// system). The ranks find out which of them see the same folder (each writes a token
// file, then each lists the tokens it sees); the lowest rank of each group writes the
// group's copy of every commit. At a resume the groups agree on the newest commit any of
// them holds; a group without it receives the file's bytes from a rank that has it, over
// the communicator, checks them by CRC as a file is checked, and keeps them as its own
// copy. docs/cluster.md describes it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace hddp {

class Communicator;

namespace train {

/// Which ranks see the same folder.
struct FolderGroups {
  std::string dir;
  /// writer[r]: the lowest rank that sees rank r's folder (the one that writes its copy).
  std::vector<int> writer;

  bool empty() const { return writer.empty(); }
  /// Whether rank `r` writes its folder's copy.
  bool writes(int r) const { return writer.at(static_cast<size_t>(r)) == r; }
  /// The number of distinct folders.
  int count() const;
};

/// Finds which ranks share `dir` (collective). Every rank calls it with its own path for
/// the same role (the save folder): the paths may differ. A missing `dir` is created with
/// `create`; else its rank is a folder of its own, which holds nothing.
FolderGroups folderGroups(Communicator& comm, const std::string& dir, bool create = true);

/// The commit a resume loads, agreed by every rank.
struct ChosenCommit {
  /// The file in this rank's folder (empty: no commit anywhere, start fresh).
  std::string path;
  /// Its payload when this rank received it over the communicator (its folder did not
  /// hold it) or read it while choosing (its folder's writer); empty when the file is
  /// read from `path`.
  std::string payload;
  int64_t step = -1;
  /// Ranks that received it, and the bytes sent to each (for the log).
  int receivers = 0;
  int64_t bytes = 0;
  double seconds = 0;
};

/// Agrees on the newest valid commit (state-NNNNNNNN.hddp) of the groups' folders
/// (collective). `accept`, when set, is asked of each file's payload by the rank that
/// scans it (whether it belongs to this job); a file it refuses is passed over. A group
/// without the chosen commit receives it from the lowest rank that has it; with `keep`
/// the group's writer stores it in its folder. A folder whose files are all invalid is
/// an error only when no folder has a valid one. Two folders' files of the chosen step
/// are one commit when `identify` (asked of the payload by the rank that scans it; unset:
/// the payload's CRC) says the same of both; a file with another id is replaced (keep) or
/// passed over, as another attempt's.
ChosenCommit chooseCommit(Communicator& comm, const FolderGroups& groups,
                          const std::function<bool(const std::string& payload)>& accept, bool keep,
                          const std::function<uint64_t(const std::string& payload)>& identify = {});

}  // namespace train
}  // namespace hddp
