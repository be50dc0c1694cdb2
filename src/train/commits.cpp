// Commits for a loop of one's own (hddp/train/commits.h).
#include "hddp/train/commits.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/state_file.h"
#include "train/state_archive.h"

namespace hddp {
namespace {

constexpr const char* kPrefix = "commit-";
constexpr const char* kStepEntry = "commit_step";

// The step a commit's archive says it holds; StateError naming `path` when it says none.
int64_t stepIn(train::InputArchive& archive, const std::string& path) {
  const at::Tensor t = train::readTensor(archive, kStepEntry, path);
  HDDP_CHECK_AS(StateError,
                t.scalar_type() == at::kLong && t.numel() == 1 && t.item<int64_t>() >= 0, "commit ",
                path, " holds no readable step; it was not written by hddp::Commits");
  return t.item<int64_t>();
}

}  // namespace

Commits::Commits(Communicator& comm, std::string dir, int keepLast)
    : comm_(comm), dir_(std::move(dir)), keepLast_(keepLast) {
  HDDP_CHECK_AS(ConfigError, !dir_.empty(), "Commits: give the folder the commits go to");
  HDDP_CHECK_AS(ConfigError, keepLast_ >= 1, "Commits: keepLast must be at least 1, not ",
                keepLast_);
}

std::string Commits::fileOf(int64_t step) const { return stateFileName(dir_, step, kPrefix); }

std::string Commits::save(int64_t step, const Write& write) {
  HDDP_CHECK_AS(ConfigError, step >= 0, "Commits::save: the step must be >= 0, not ", step);
  const std::string path = fileOf(step);
  const auto outcomes = runAndShareOutcome(comm_, comm_.rank() == 0, [&] {
    train::OutputArchive archive;
    write(archive);
    archive.write(kStepEntry, at::tensor(std::vector<int64_t>{step}, at::kLong));
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    HDDP_CHECK_AS(StateError, !ec, "cannot create the commit folder ", dir_, ": ", ec.message());
    writeStateFile(path, train::archiveBytes(archive));
    pruneStateFiles(dir_, keepLast_, kPrefix);
  });
  const int failed = firstFailed(outcomes);
  HDDP_CHECK_AS(StateError, failed < 0, "committing step ", step, " to ", path, " failed on rank ",
                failed, ": ",
                failed < 0 ? std::string() : outcomes[static_cast<size_t>(failed)].message);
  HDDP_LOG_INFO("train", "committed step ", step, " to ", path);
  return path;
}

std::optional<int64_t> Commits::resume(const Read& read) {
  // Rank 0 chooses: the newest file that reads whole and says its step.
  std::string chosen;
  const auto chose = runAndShareOutcome(comm_, comm_.rank() == 0, [&] {
    const std::vector<std::string> files = listStateFiles(dir_, kPrefix);
    for (auto it = files.rbegin(); it != files.rend() && chosen.empty(); ++it) {
      try {
        train::InputArchive archive;
        train::loadArchive(archive, readStateFile(*it), "commit " + *it, c10::Device(c10::kCPU));
        stepIn(archive, *it);
        chosen = *it;
      } catch (const StateError& e) {
        // Kept for a look, out of the commits' way: counted among them, damaged newer
        // files would make the pruning after the next commit delete that commit.
        const std::string aside = *it + ".damaged";
        const bool moved = std::rename(it->c_str(), aside.c_str()) == 0;
        HDDP_LOG_WARN("train", "skipping the damaged commit ", *it, " (",
                      moved ? "moved to " + aside : std::string("left where it is"),
                      "): ", e.what_without_backtrace());
      }
    }
    HDDP_CHECK_AS(StateError, files.empty() || !chosen.empty(), "every commit in ", dir_,
                  " is damaged (", files.size(), " of them); nothing can be resumed");
  });
  const int failed = firstFailed(chose);
  if (failed >= 0) {
    throwAs(chose[static_cast<size_t>(failed)].failure, chose[static_cast<size_t>(failed)].message);
  }
  chosen = broadcastBytes(comm_, 0, chosen);
  if (chosen.empty()) {
    return std::nullopt;
  }
  // Every rank reads the chosen file, then `read` takes it; a failure anywhere ends the
  // resume everywhere.
  train::InputArchive archive;
  int64_t step = 0;
  agreeOutcome<StateError>(comm_, "reading the commit " + chosen, [&] {
    train::loadArchive(archive, readStateFile(chosen), "commit " + chosen, c10::Device(c10::kCPU));
    step = stepIn(archive, chosen);
  });
  agreeOutcome<StateError>(comm_, "loading the commit " + chosen, [&] {
    try {
      read(archive);
    } catch (const StateError&) {
      throw;
    } catch (...) {  // what `read` or LibTorch refused: the commit does not fit, on any rank
      rethrowIfOutOfMemory();
      HDDP_THROW(StateError, "loading the commit ", chosen, " failed: ", currentFailure().message);
    }
  });
  HDDP_LOG_SHARED("train", comm_.rank(), "resumed from ", chosen, " at step ", step);
  return step;
}

}  // namespace hddp
