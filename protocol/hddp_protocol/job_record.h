// The record of an elastic job (docs/elastic.md): `<job folder>/job.jsonl`, appended by
// hddp-run (generations, slots that leave and come back, the end) and by rank 0 of each
// generation (started/resumed, first_step, commit). hddp-run prints its summary when the
// job ends; `hddp-probe --job DIR` shows it while the job runs or after (--job-dir).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace hddp {
namespace jobrecord {

/// Appends one event line to `dir`/job.jsonl: {"t": unix seconds, "event": event,
/// "generation": generation, ...fields}. One write(2) of an O_APPEND file: lines of
/// several writers never interleave. Errors are ignored (the record is for people).
void append(const std::string& dir, const std::string& event, int generation,
            const nlohmann::json& fields = nlohmann::json::object());

/// The same lines from a writer that keeps the file open (rank 0 of a generation).
/// Used from one thread.
class Writer {
 public:
  Writer() = default;
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  ~Writer();
  /// Opens `dir`/job.jsonl for appending; no-op when `dir` is empty.
  void open(const std::string& dir, int generation);
  bool enabled() const { return fd_ >= 0; }
  /// Appends {"t": <unix seconds>, "event": <event>, "generation": g, ...fields}.
  void add(const std::string& event, const nlohmann::json& fields = nlohmann::json::object());

 private:
  int fd_ = -1;
  int generation_ = 0;
};

struct Generation {
  int number = 0;
  double start = 0;          // hddp-run started its ranks (unix seconds)
  std::vector<int> slots;    // the slots that run a rank
  int64_t resumedStep = -1;  // the step rank 0 resumed from; -1: not yet reported
  int64_t repeated = 0;      // steps trained again after the resumed commit
  double firstStep = -1;     // rank 0 finished the generation's first step
  double cause = -1;         // what made the previous generation end (unplug, exit)
  std::string causeText;     // "slot 2 left", "slot 2 came back"
  std::string commits;       // the commit folder the ranks use
};

struct Departure {
  int slot = 0;
  int generation = 0;
  double at = 0;
  std::string why;
  double back = -1;  // its rejoin check passed; -1: not (yet)
};

struct Job {
  double start = -1;  // hddp-run's "job" event
  int minRanks = 0, maxRanks = 0;
  long pid = 0;  // hddp-run's process
  std::vector<Generation> generations;
  std::vector<Departure> departures;
  int64_t commitStep = -1;  // the newest commit
  double commitAt = -1;
  std::string commitFile;
  bool ended = false;
  double endAt = -1;
  int exitCode = 0;
  std::string endWhy;
  int skippedLines = 0;  // lines that did not parse (a torn last line of a killed writer)
};

/// Reads `dir`/job.jsonl. Throws std::runtime_error naming the file when it cannot be
/// read or holds no "job" event (not an elastic job's folder).
Job read(const std::string& dir);

/// Steps trained twice over the job: the sum of each generation's repeated steps.
int64_t repeatedSteps(const Job& job);
/// Seconds from what ended the previous generation to the first step of `g` (>= 1);
/// -1 while unknown.
double reformSeconds(const Generation& g);

/// The job as lines of text, times relative to the start; `now` (unix seconds) dates a
/// running job's newest commit.
std::vector<std::string> describe(const Job& job, double now);
/// The same as JSON (hddp-probe --job DIR --json).
nlohmann::json toJson(const Job& job);

/// Unix seconds now.
double unixNow();

}  // namespace jobrecord
}  // namespace hddp
