// Faults on purpose (issue #49): an injection point set by the environment, for tests,
// benchmarks and chaos runs instead of ad-hoc kills. Off unless HDDP_FAULT is set, and
// logged as a warning when on.
//
//   HDDP_FAULT="kill@step=5,rank=1;nospace@save=2;slow=3@step=10,rank=0,restart=*"
//
// Each entry is KIND@POINT=N with optional filters, entries separated by ';':
//   KIND    kill (SIGKILL itself), raise (throws hddp::Error), hang (sleeps until killed),
//           slow=SECONDS (sleeps, then goes on), nospace (a save fails as on a full disk;
//           save only), drop (the connection to the store drops: this operation and
//           every later one on that store fail with a hddp::StoreError; store only)
//   POINT   step=N (before the forward of the job's step N, 1-based, counted as the
//           Trainer counts its steps), save=N (the N-th state file this rank writes
//           since fit() began), collective=N (the N-th collective this rank launches
//           since fit() began, on any of its communicators and from any thread: DDP's
//           buckets launch from the autograd thread; raise fails the launch with a
//           hddp::DistributedError and nothing is sent, as a lost connection would),
//           store=N (the N-th operation on a store by this process's rank when it joins
//           the job, hddp::initFromEnv: the rendezvous and the exchange of devices)
//   rank=R  only on rank R (default: every rank)
//   slot=S  only on the elastic job's slot S (hddp-run --nproc-per-node MIN:MAX; a
//           slot keeps its number when the ranks are numbered again)
//   restart=K  only in the job's K-th restart (torchrun's or Slurm's restart count);
//           default 0, the first attempt, so that a resumed job does not meet the same
//           fault again; * for every attempt
//
// A fault acts once per process; with HDDP_FAULT_ONCE_DIR=DIR once per job: the first
// process to meet it marks DIR/fault-<entry> (created exclusively) and later ones pass.
//
// Thread safety: the plan and the counts of step and save are per thread (the ranks of a
// test are threads of one process); arm() on the thread that trains. Collective faults
// are kept per rank for the whole process (a collective may launch on another thread).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hddp {
namespace fault {

enum class Kind { Kill, Raise, Hang, Slow, NoSpace, Drop };
enum class Point { Step, Save, Collective, Store };

struct Fault {
  Kind kind = Kind::Raise;
  double seconds = 0;  // Slow
  Point point = Point::Step;
  int64_t at = 0;
  int rank = -1;     // -1: every rank
  int slot = -1;     // -1: every slot
  int restart = 0;   // -1: every attempt
  std::string text;  // the entry as given, for messages
};

/// Parses HDDP_FAULT's grammar (above). hddp::ConfigError naming the entry and what is
/// wrong.
std::vector<Fault> parse(const std::string& text);

/// Reads HDDP_FAULT and keeps, for this thread, the faults meant for `rank` (and the
/// elastic `slot`, -1 for none) in the job's `restart`-th attempt (under hddp-run's
/// elastic mode: its generation); resets this thread's save count. Logs the armed faults.
void arm(int rank, int restart, int slot = -1);
/// Forgets this thread's faults.
void disarm();

/// An injection point: acts on the first armed fault of `point` at `count`. For Save
/// the count is kept here (call it once per state file written; it returns normally
/// or throws). A fault acts once.
void at(Point point, int64_t count);
/// Save: counts this state file and throws a StateError "No space left on device" when
/// a nospace fault is armed for it (other kinds act as at() does).
void beforeSave(const std::string& path);
/// Keeps, for this thread, the store faults meant for `rank` (`slot`, `restart`: as
/// arm()); hddp::initFromEnv calls it before it opens the job's store. Resets the count.
void armStore(int rank, int restart, int slot = -1);
/// Forgets this thread's store faults (hddp::initFromEnv, once the rank has joined).
void disarmStore();
/// A store operation (`what` describes it) on this thread: counts it and acts on a
/// store fault armed for that count. Returns true when a drop acted: the caller marks
/// its store dropped and fails this operation and every later one.
bool beforeStoreOp(const std::string& what);

/// A collective of `rank`'s communicator is about to launch (`what` describes it):
/// counts it and acts on a collective fault armed for `rank` at that count (raise:
/// a hddp::DistributedError). Costs one atomic load while no collective fault is armed.
void beforeCollective(int rank, const std::string& what);

}  // namespace fault
}  // namespace hddp
