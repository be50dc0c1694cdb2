// Commit folders that not every rank shares (commit_folders.h).
#include "train/commit_folders.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>
#include <set>

#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/state_file.h"

namespace hddp {
namespace train {
namespace {

namespace fs = std::filesystem;

// Throws, on every rank alike, what rank `r` said when it failed: out of memory, which no
// file causes and no rank may skip past, as an hddp::Error; anything else (the folder or
// its files) as a StateError.
void throwIfFailed(int r, const RankOutcome& said, const std::string& what) {
  if (!said.failed()) {
    return;
  }
  HDDP_CHECK(said.failure != FailureKind::OutOfMemory, what, ": rank ", r, " ran out of memory (",
             said.message, ")");
  HDDP_THROW(StateError, what, ": rank ", r, ": ", said.message);
}

std::string tokenName(const std::string& nonce, int rank) {
  return ".hddp-folder-" + nonce + "-" + std::to_string(rank);
}

// What a writer found in its folder (chooseCommit), every rank's by rank.
struct FolderScan {
  int64_t refused = 0;  // valid files `accept` refused (another job's)
  int64_t step = -1;    // the newest valid commit's step (when found)
  uint64_t id = 0;      // and its id
  int32_t found = 0;    // 1: step and id name a commit
  int32_t unused = 0;   // no padding travels unset
};

}  // namespace

int FolderGroups::count() const {
  return static_cast<int>(std::set<int>(writer.begin(), writer.end()).size());
}

FolderGroups folderGroups(Communicator& comm, const std::string& dir, bool create) {
  FolderGroups groups;
  groups.dir = dir;
  // Rank 0's nonce names this exchange's tokens, so that tokens another job (or an
  // interrupted one) left behind are not taken for this job's ranks.
  std::string nonce;
  if (comm.rank() == 0) {
    std::random_device device;
    char text[40];
    std::snprintf(text, sizeof(text), "%08x%08x-%d", device(), device(),
                  static_cast<int>(getpid()));
    nonce = text;
  }
  nonce = broadcastBytes(comm, 0, nonce);
  RankOutcome problem;
  const fs::path mine = fs::path(dir) / tokenName(nonce, comm.rank());
  std::error_code missing;
  bool alone = !create && !fs::is_directory(dir, missing);
  if (!alone) try {
      std::error_code ec;
      fs::create_directories(dir, ec);
      HDDP_CHECK_AS(StateError, !ec, "cannot create the save folder ", dir, ": ", ec.message());
      std::ofstream token(mine);
      // A folder only read from (--resume of a read-only folder) may refuse the token: its
      // rank then scans it on its own, as does every other rank that cannot write there.
      alone = !create && !token.good();
      HDDP_CHECK_AS(StateError, alone || token.good(), "cannot write in the save folder ", dir,
                    " (read-only? full?)");
    } catch (...) {  // whatever it is, the others hear of it in the allgather below
      problem = currentFailure();
    }
  // Every rank's token is written before any rank looks.
  const auto written = allgatherOutcomes(comm, problem);
  // The lowest rank whose token this rank sees: the writer of its folder.
  RankResult<int32_t> lowest;
  lowest.value = comm.rank();
  if (!problem.failed() && !alone) try {
      // A listing, not a lookup by name: opening the folder revalidates it on a network
      // file system, where a lookup may answer from a cache that has not seen the file.
      std::set<std::string> seen;
      std::error_code ec;
      for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        seen.insert(it->path().filename().string());
      }
      HDDP_CHECK_AS(StateError, !ec, "cannot list the save folder ", dir, ": ", ec.message());
      for (int r = 0; r < comm.size(); ++r) {
        if (!written[static_cast<size_t>(r)].failed() && seen.count(tokenName(nonce, r))) {
          lowest.value = r;
          break;
        }
      }
    } catch (...) {  // told in the allgather below, so that no rank leaves before it
      static_cast<RankOutcome&>(lowest) = currentFailure();
    }
  const auto all = allgatherResults(comm, lowest);
  std::error_code ec;
  if (!alone) {
    fs::remove(mine, ec);
  }
  for (int r = 0; r < comm.size(); ++r) {
    throwIfFailed(r, written[static_cast<size_t>(r)], "the save folder " + dir);
  }
  for (int r = 0; r < comm.size(); ++r) {
    const RankResult<int32_t>& said = all[static_cast<size_t>(r)];
    throwIfFailed(r, said, "the save folder " + dir);
    HDDP_CHECK(said.value >= 0 && said.value < comm.size(), "the save folder ", dir, ": rank ", r,
               " named rank ", said.value, " its folder's writer");
    groups.writer.push_back(said.value);
  }
  if (groups.count() > 1) {
    std::string writers;
    for (int r = 0; r < comm.size(); ++r) {
      if (groups.writes(r)) {
        writers += (writers.empty() ? "" : ",") + std::to_string(r);
      }
    }
    HDDP_LOG_SHARED("train", comm.rank(),
                    "the save folder is not shared by every rank: ", groups.count(),
                    " folders, whose copies of each commit ranks ", writers,
                    " write; a resume sends the newest commit to the folders without it");
  }
  return groups;
}

ChosenCommit chooseCommit(Communicator& comm, const FolderGroups& groups,
                          const std::function<bool(const std::string&)>& accept, bool keep,
                          const std::function<uint64_t(const std::string&)>& identify) {
  HDDP_CHECK(static_cast<int>(groups.writer.size()) == comm.size(),
             "chooseCommit: the folder groups are not this communicator's");
  const int rank = comm.rank();
  // Each writer scans its folder and tells what it found (FolderScan), or its problem.
  RankResult<FolderScan> mine;
  FolderScan& found = mine.value;
  std::string scanned;  // the payload of the newest valid file of this writer
  if (groups.writes(rank)) {
    try {
      std::error_code ec;
      fs::directory_iterator listing(groups.dir, ec);
      HDDP_CHECK_AS(StateError, !ec || ec == std::errc::no_such_file_or_directory,
                    "cannot list the save folder ", groups.dir, ": ", ec.message());
      const auto files = listStateFiles(groups.dir);
      for (auto it = files.rbegin(); it != files.rend() && found.found == 0; ++it) {
        try {
          std::string payload = readStateFile(*it);
          if (accept && !accept(payload)) {
            ++found.refused;
            continue;
          }
          const std::string name = fs::path(*it).filename().string();
          // state-N.hddp, and the commit's id: two folders may hold different files of
          // the same step (a folder reused from another attempt), which must not both load.
          const uint64_t id =
              identify ? identify(payload) : crc32Of(payload.data(), payload.size());
          found.step = std::stoll(name.substr(6, name.size() - 6 - 5));
          found.id = id;
          found.found = 1;
          scanned = std::move(payload);
        } catch (const std::exception&) {  // a damaged file, or one `accept` cannot read
          const RankOutcome failure = currentFailure();
          if (failure.failure == FailureKind::OutOfMemory) {
            throw;  // no verdict on the file (host memory too): reported below
          }
          HDDP_LOG_WARN("train", "skipping ", *it, ": ", failure.message);
        }
      }
      const size_t refused = static_cast<size_t>(found.refused);
      if (found.found == 0 && files.size() > refused) {
        mine.failure = FailureKind::State;
        mine.message = "none of the " + std::to_string(files.size() - refused) +
                       " state files (state-NNNNNNNN.hddp) in " + groups.dir +
                       " is valid (see the warnings above); move them away to start fresh";
      }
    } catch (...) {  // an unreadable folder, or out of memory (fails every rank)
      static_cast<RankOutcome&>(mine) = currentFailure();
    }
  }
  const auto all = allgatherResults(comm, mine);
  ChosenCommit chosen;
  int source = -1;
  std::string problem;
  size_t passedOver = 0;
  std::vector<int64_t> steps(static_cast<size_t>(comm.size()), -1);
  std::vector<uint64_t> ids(static_cast<size_t>(comm.size()), 0);
  for (int r = 0; r < comm.size(); ++r) {
    const RankResult<FolderScan>& said = all[static_cast<size_t>(r)];
    passedOver += static_cast<size_t>(said.value.refused);
    if (said.failure == FailureKind::OutOfMemory) {  // a failure, never a folder to pass over
      throwIfFailed(r, said, "cannot resume");
    }
    if (said.failed()) {
      problem = problem.empty() ? "rank " + std::to_string(r) + ": " + said.message : problem;
      continue;
    }
    if (said.value.found == 0) {
      continue;
    }
    steps[static_cast<size_t>(r)] = said.value.step;
    ids[static_cast<size_t>(r)] = said.value.id;
    if (steps[static_cast<size_t>(r)] > chosen.step) {
      chosen.step = steps[static_cast<size_t>(r)];
      source = r;
    }
  }
  if (passedOver > 0) {
    HDDP_LOG_WARN("train", "passed over ", passedOver,
                  " state file(s) of another job in the save folder(s); keeping the newest "
                  "files by step may delete this job's commits among them: give each job its "
                  "own save folder");
  }
  if (source >= 0 && !problem.empty()) {
    HDDP_LOG_WARN("train", "a save folder could not be read (", problem,
                  "); resuming from another folder's newest commit");
  }
  if (source < 0) {
    HDDP_CHECK_AS(StateError, problem.empty(), "cannot resume: ", problem);
    return chosen;  // no commit anywhere: start fresh
  }
  // Folders without the chosen step receive it from the source.
  const int myWriter = groups.writer[static_cast<size_t>(rank)];
  std::vector<bool> lacks(static_cast<size_t>(comm.size()), false);
  const uint64_t chosenId = ids[static_cast<size_t>(source)];
  for (int r = 0; r < comm.size(); ++r) {
    const int w = groups.writer[static_cast<size_t>(r)];
    const bool sameStep = steps[static_cast<size_t>(w)] == chosen.step;
    // A file of the chosen step of another commit is another attempt's: replaced by the
    // source's, so that every rank loads the same state.
    lacks[static_cast<size_t>(r)] = !sameStep || ids[static_cast<size_t>(w)] != chosenId;
    if (sameStep && lacks[static_cast<size_t>(r)] && r == rank && groups.writes(rank)) {
      HDDP_LOG_WARN("train", "the save folder ", groups.dir, "'s file of step ", chosen.step,
                    " is another attempt's than rank ", source, "'s: rank ", source, "'s is loaded",
                    keep ? " and replaces it" : "");
    }
    chosen.receivers += lacks[static_cast<size_t>(r)] ? 1 : 0;
  }
  chosen.path = stateFileName(groups.dir, chosen.step);
  // A writer whose folder holds the chosen commit has just read and checked it: the load
  // takes those bytes rather than reading the file again.
  const bool scannedIsChosen = groups.writes(rank) && !lacks[static_cast<size_t>(rank)];
  if (chosen.receivers == 0) {
    if (scannedIsChosen) {
      chosen.payload = std::move(scanned);
    }
    return chosen;
  }
  const auto t0 = std::chrono::steady_clock::now();
  // The payload and its CRC, as the source's file holds them.
  std::string sent;
  if (rank == source) {
    const uint32_t crc = crc32Of(scanned.data(), scanned.size());
    sent.assign(reinterpret_cast<const char*>(&crc), sizeof(crc));
    sent += scanned;
  }
  std::string got = broadcastBytes(comm, source, sent);
  chosen.bytes = static_cast<int64_t>(got.size());
  chosen.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RankOutcome problemHere;
  if (lacks[static_cast<size_t>(rank)]) {
    try {
      HDDP_CHECK_AS(StateError, got.size() >= sizeof(uint32_t), "the commit sent by rank ", source,
                    " is truncated");
      uint32_t crc = 0;
      std::memcpy(&crc, got.data(), sizeof(crc));
      chosen.payload = got.substr(sizeof(crc));
      const uint32_t actual = crc32Of(chosen.payload.data(), chosen.payload.size());
      HDDP_CHECK_AS(StateError, actual == crc, "the commit of step ", chosen.step, " sent by rank ",
                    source, " arrived corrupt: checksum mismatch (sent ", crc, ", computed ",
                    actual, ")");
      if (keep && myWriter == rank) {
        writeStateFile(chosen.path, chosen.payload);
      }
    } catch (...) {  // whatever it is (out of memory too), the others hear of it below
      problemHere = currentFailure();
    }
  }
  // Every rank learns whether the transfer worked, so none trains on alone.
  const auto outcome = allgatherOutcomes(comm, problemHere);
  for (int r = 0; r < comm.size(); ++r) {
    throwIfFailed(r, outcome[static_cast<size_t>(r)], "cannot resume");
  }
  if (scannedIsChosen && chosen.payload.empty()) {
    chosen.payload = std::move(scanned);
  }
  std::set<int> lacking;
  for (int r = 0; r < comm.size(); ++r) {
    if (lacks[static_cast<size_t>(r)]) {
      lacking.insert(groups.writer[static_cast<size_t>(r)]);
    }
  }
  HDDP_LOG_SHARED("train", rank, "the newest commit, step ", chosen.step, ", was in ",
                  groups.count() - static_cast<int>(lacking.size()), " of ", groups.count(),
                  " save folders; rank ", source, " sent it (",
                  static_cast<double>(chosen.bytes) / 1e6, " MB) to the ", chosen.receivers,
                  " rank(s) without it in ", chosen.seconds, " s",
                  keep ? "; their folders keep a copy" : "");
  return chosen;
}

}  // namespace train
}  // namespace hddp
