// Faults on purpose (hddp/core/fault.h).
#include "hddp/core/fault.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace fault {
namespace {

struct Armed {
  std::vector<Fault> faults;
  std::vector<bool> done;
  int rank = -1;
  int64_t saves = 0;
};

thread_local Armed armed;
thread_local Armed storeArmed;  // Point::Store's faults; `saves` counts the operations

// Collective faults, per rank for the whole process: DDP launches its buckets from the
// autograd thread (a device's own thread on an accelerator), not the one that armed.
struct RankCollectives {
  std::vector<Fault> faults;
  std::vector<bool> done;
  int64_t launched = 0;
};
std::mutex collectivesMutex;
std::map<int, RankCollectives>& collectives() {
  static auto* byRank = new std::map<int, RankCollectives>();  // never destroyed: exit-safe
  return *byRank;
}
std::atomic<size_t> ranksWithCollectiveFaults{0};

constexpr const char* kGrammar =
    "KIND@POINT=N[,rank=R][,slot=S][,restart=K|*] entries separated by ';', KIND one of kill, "
    "raise, "
    "hang, slow=SECONDS, nospace, drop; POINT one of step, save, collective, store";

[[noreturn]] void bad(const std::string& entry, const std::string& what) {
  HDDP_THROW(ConfigError, "HDDP_FAULT entry '", entry, "': ", what, " (expected ", kGrammar, ")");
}

int64_t number(const std::string& entry, const std::string& text, const char* what) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v < 0 || v > std::numeric_limits<int>::max()) {
    bad(entry, std::string(what) + " '" + text + "' is not a non-negative integer");
  }
  return v;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(text);
  while (std::getline(in, item, sep)) {
    out.push_back(item);
  }
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

const char* pointName(Point p) {
  switch (p) {
    case Point::Step:
      return "step";
    case Point::Save:
      return "save";
    case Point::Collective:
      return "collective";
    case Point::Store:
      return "store";
  }
  return "?";
}

// With HDDP_FAULT_ONCE_DIR a fault acts once per job, whichever process meets it first:
// a marker file named by the entry, created exclusively, says it has acted. (Without it,
// once per process.)
bool firstInJob(const Fault& f) {
  const auto dir = env::lookup("HDDP_FAULT_ONCE_DIR");
  if (!dir || dir->empty()) {
    return true;
  }
  std::string name = "fault-";
  for (const char c : f.text) {
    name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  }
  const std::string path = *dir + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    HDDP_CHECK_AS(ConfigError, errno == EEXIST, "HDDP_FAULT_ONCE_DIR: cannot create ", path, ": ",
                  std::strerror(errno));
    return false;
  }
  ::close(fd);
  return true;
}

void act(const Fault& f, const std::string& where) {
  if (!firstInJob(f)) {
    return;
  }
  HDDP_LOG_WARN("fault", "injecting '", f.text, "' (HDDP_FAULT) ", where);
  switch (f.kind) {
    case Kind::Kill:
      std::fflush(nullptr);
      std::raise(SIGKILL);
      break;
    case Kind::Raise:
      HDDP_THROW(Error, "fault injected by HDDP_FAULT ('", f.text, "') ", where);
    case Kind::Hang:
      for (;;) {
        std::this_thread::sleep_for(std::chrono::hours(1));
      }
    case Kind::Slow:
      std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
      break;
    case Kind::NoSpace:
      HDDP_THROW(StateError, "No space left on device (fault injected by HDDP_FAULT, '", f.text,
                 "') ", where);
    case Kind::Drop:
      break;  // the store marks itself dropped (beforeStoreOp)
  }
}

}  // namespace

std::vector<Fault> parse(const std::string& text) {
  std::vector<Fault> out;
  for (const std::string& raw : split(text, ';')) {
    const std::string entry = trim(raw);
    if (entry.empty()) {
      continue;
    }
    Fault f;
    f.text = entry;
    const auto atSign = entry.find('@');
    if (atSign == std::string::npos) {
      bad(entry, "no '@' between the kind and the point");
    }
    const std::string kind = entry.substr(0, atSign);
    if (kind == "kill") {
      f.kind = Kind::Kill;
    } else if (kind == "raise") {
      f.kind = Kind::Raise;
    } else if (kind == "hang") {
      f.kind = Kind::Hang;
    } else if (kind == "nospace") {
      f.kind = Kind::NoSpace;
    } else if (kind == "drop") {
      f.kind = Kind::Drop;
    } else if (kind.rfind("slow=", 0) == 0) {
      f.kind = Kind::Slow;
      try {
        size_t used = 0;
        f.seconds = std::stod(kind.substr(5), &used);
        if (used != kind.size() - 5 || !(f.seconds >= 0) || f.seconds > 86400) {
          bad(entry, "slow's seconds must be a number from 0 to 86400");
        }
      } catch (const std::logic_error&) {
        bad(entry, "slow's seconds must be a number from 0 to 86400");
      }
    } else {
      bad(entry, "unknown kind '" + kind + "'");
    }
    const auto parts = split(entry.substr(atSign + 1), ',');
    if (parts.empty()) {
      bad(entry, "no point after '@'");
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::string part = trim(parts[i]);
      const auto eq = part.find('=');
      if (eq == std::string::npos) {
        bad(entry, "'" + part + "' is not NAME=VALUE");
      }
      const std::string name = part.substr(0, eq);
      const std::string value = part.substr(eq + 1);
      if (i == 0) {
        if (name == "step") {
          f.point = Point::Step;
        } else if (name == "save") {
          f.point = Point::Save;
        } else if (name == "collective") {
          f.point = Point::Collective;
        } else if (name == "store") {
          f.point = Point::Store;
        } else {
          bad(entry, "unknown point '" + name + "'");
        }
        f.at = number(entry, value, "the point's count");
        if (f.at < 1) {
          bad(entry, "points count from 1");
        }
      } else if (name == "rank") {
        f.rank = static_cast<int>(number(entry, value, "rank"));
      } else if (name == "slot") {
        f.slot = static_cast<int>(number(entry, value, "slot"));
      } else if (name == "restart") {
        f.restart = value == "*" ? -1 : static_cast<int>(number(entry, value, "restart"));
      } else {
        bad(entry, "unknown filter '" + name + "' (rank, slot or restart)");
      }
    }
    if (f.kind == Kind::NoSpace && f.point != Point::Save) {
      bad(entry, "nospace applies to save only");
    }
    if (f.kind == Kind::Drop && f.point != Point::Store) {
      bad(entry, "drop applies to store only");
    }
    out.push_back(f);
  }
  return out;
}

namespace {

// Keeps `rank`'s collective faults of `faults` (none: forgets the rank's).
void setCollectives(int rank, const std::vector<Fault>& faults) {
  RankCollectives mine;
  for (const Fault& f : faults) {
    if (f.point == Point::Collective) {
      mine.faults.push_back(f);
    }
  }
  mine.done.assign(mine.faults.size(), false);
  std::lock_guard<std::mutex> lock(collectivesMutex);
  if (mine.faults.empty()) {
    collectives().erase(rank);
  } else {
    collectives()[rank] = std::move(mine);
  }
  ranksWithCollectiveFaults.store(collectives().size());
}

}  // namespace

void arm(int rank, int restart, int slot) {
  disarm();
  armed.rank = rank;
  const auto text = env::lookup("HDDP_FAULT");
  if (!text || text->empty()) {
    return;
  }
  for (const Fault& f : parse(*text)) {
    if ((f.rank < 0 || f.rank == rank) && (f.slot < 0 || f.slot == slot) &&
        (f.restart < 0 || f.restart == restart)) {
      armed.faults.push_back(f);
    }
  }
  armed.done.assign(armed.faults.size(), false);
  setCollectives(rank, armed.faults);
  std::string list;
  for (const Fault& f : armed.faults) {
    list += (list.empty() ? "" : "; ") + f.text;
  }
  HDDP_LOG_WARN("fault", "fault injection is on (HDDP_FAULT=", *text, "): rank ", rank,
                slot >= 0 ? " (slot " + std::to_string(slot) + ")" : std::string(), " in attempt ",
                restart, " will meet ", armed.faults.empty() ? std::string("none of them") : list);
}

void disarm() {
  if (armed.rank >= 0) {
    setCollectives(armed.rank, {});
  }
  armed = Armed{};
}

void at(Point point, int64_t count) {
  for (size_t i = 0; i < armed.faults.size(); ++i) {
    const Fault& f = armed.faults[i];
    if (!armed.done[i] && f.point == point && f.at == count) {
      armed.done[i] = true;
      std::ostringstream where;
      where << "at " << pointName(point) << " " << count << " on rank " << armed.rank;
      act(f, where.str());
    }
  }
}

void beforeSave(const std::string& path) {
  if (armed.faults.empty()) {
    return;
  }
  ++armed.saves;
  for (size_t i = 0; i < armed.faults.size(); ++i) {
    const Fault& f = armed.faults[i];
    if (!armed.done[i] && f.point == Point::Save && f.at == armed.saves) {
      armed.done[i] = true;
      act(f, "writing " + path + " on rank " + std::to_string(armed.rank));
    }
  }
}

void beforeCollective(int rank, const std::string& what) {
  if (ranksWithCollectiveFaults.load() == 0) {
    return;
  }
  Fault hit;
  bool found = false;
  int64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(collectivesMutex);
    const auto it = collectives().find(rank);
    if (it == collectives().end()) {
      return;
    }
    RankCollectives& mine = it->second;
    count = ++mine.launched;
    for (size_t i = 0; i < mine.faults.size() && !found; ++i) {
      if (!mine.done[i] && mine.faults[i].at == count) {
        mine.done[i] = true;
        hit = mine.faults[i];
        found = true;
      }
    }
  }
  if (!found) {
    return;
  }
  std::ostringstream where;
  where << "at collective " << count << " (" << what << ") on rank " << rank;
  if (hit.kind == Kind::Raise) {
    if (firstInJob(hit)) {
      HDDP_LOG_WARN("fault", "injecting '", hit.text, "' (HDDP_FAULT) ", where.str());
      HDDP_THROW(DistributedError, "collective failed: fault injected by HDDP_FAULT ('", hit.text,
                 "') ", where.str(), "; nothing was sent");
    }
    return;
  }
  act(hit, where.str());
}

void armStore(int rank, int restart, int slot) {
  storeArmed = Armed{};
  storeArmed.rank = rank;
  const auto text = env::lookup("HDDP_FAULT");
  if (!text || text->empty()) {
    return;
  }
  for (const Fault& f : parse(*text)) {
    if (f.point == Point::Store && (f.rank < 0 || f.rank == rank) &&
        (f.slot < 0 || f.slot == slot) && (f.restart < 0 || f.restart == restart)) {
      storeArmed.faults.push_back(f);
    }
  }
  storeArmed.done.assign(storeArmed.faults.size(), false);
  if (!storeArmed.faults.empty()) {
    HDDP_LOG_WARN("fault", "fault injection is on (HDDP_FAULT=", *text, "): rank ", rank,
                  " in attempt ", restart, " has ", storeArmed.faults.size(),
                  " store fault(s) armed");
  }
}

void disarmStore() { storeArmed = Armed{}; }

bool beforeStoreOp(const std::string& what) {
  if (storeArmed.faults.empty()) {
    return false;
  }
  const int64_t count = ++storeArmed.saves;
  for (size_t i = 0; i < storeArmed.faults.size(); ++i) {
    const Fault& f = storeArmed.faults[i];
    if (storeArmed.done[i] || f.at != count) {
      continue;
    }
    storeArmed.done[i] = true;
    const std::string where = "at store operation " + std::to_string(count) + " (" + what +
                              ") on rank " + std::to_string(storeArmed.rank);
    if (f.kind == Kind::Drop) {
      if (!firstInJob(f)) {
        return false;
      }
      HDDP_LOG_WARN("fault", "injecting '", f.text, "' (HDDP_FAULT) ", where);
      return true;
    }
    act(f, where);
  }
  return false;
}

}  // namespace fault
}  // namespace hddp
