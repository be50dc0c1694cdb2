// Commits for a loop of one's own: numbered state files (hddp/train/state_file.h's
// format, a torch archive inside) in a folder that every rank sees, written atomically by
// rank 0 and resumed from the newest one that reads whole, on every rank alike. The
// Trainer's commits add per-rank save folders and elastic jobs on top; a loop of its own
// gets the common case:
//
//   hddp::Commits commits(comm, "ckpt");
//   int64_t step = commits.resume([&](torch::serialize::InputArchive& a) {
//     ... model, optimizer, sampler, planner from `a` ...
//   }).value_or(0);
//   ...
//   if (step % 50 == 0) {
//     commits.save(step, [&](torch::serialize::OutputArchive& a) { ... the same into a ... });
//   }
//
// A launcher's restart (hddp-run --max-restarts, torchrun, a requeued Slurm job) then goes
// on from the newest commit: nothing committed is trained again, nothing is skipped.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace torch {
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace hddp {

class Communicator;

class Commits {
 public:
  using Write = std::function<void(torch::serialize::OutputArchive&)>;
  using Read = std::function<void(torch::serialize::InputArchive&)>;

  /// Commits go to `dir` (created when missing) as commit-<step, 8 digits>.hddp; the
  /// newest `keepLast` are kept. hddp::ConfigError for an empty folder name or keepLast
  /// below 1. Keeps a reference to `comm`, which must outlive it.
  Commits(Communicator& comm, std::string dir, int keepLast = 3);

  /// Collective. `write` fills the archive on rank 0 only, so it holds what every rank
  /// holds alike (the model, the optimizer, the sampler's position, the planner's shared
  /// part) and runs no collective. Rank 0 writes it as the commit of `step` (with the
  /// step inside), atomically, and keeps the newest keepLast. Every rank learns how it
  /// went: a failure (a full disk, `write` throwing) is an hddp::StateError on every rank
  /// with rank 0's message, and the earlier commits stay. Returns the path.
  std::string save(int64_t step, const Write& write);

  /// Collective. The newest commit of the folder that reads whole (a damaged newer one is
  /// skipped and renamed <file>.damaged, and the log says so), chosen by rank 0 and read by every
  /// rank; `read` takes its archive on every rank and runs no collective. Returns the commit's
  /// step, or nullopt when the folder holds no commit (or does not exist). An hddp::StateError on
  /// every rank when every commit is damaged, when a rank cannot read the chosen file
  /// (the folder must be one that every rank sees), or when `read` throws on some rank
  /// (what `read` changed before it threw is the caller's to undo).
  std::optional<int64_t> resume(const Read& read);

  const std::string& dir() const { return dir_; }
  /// The file the commit of `step` goes to.
  std::string fileOf(int64_t step) const;

 private:
  Communicator& comm_;
  std::string dir_;
  int keepLast_;
};

}  // namespace hddp
