#include "hddp_protocol/job_record.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

#include "hddp_protocol/launch.h"

namespace hddp {
namespace jobrecord {
namespace {

// A number the record's readers convert to an integer must fit the integer: "t" is a
// double, "pid", "step" and "repeated" are int64 (kept within 2^53, where a double is
// exact), every other number (generation, slot, min, max, code, the slots listed) is an
// int. A line with a number out of range is skipped, as a line that is not JSON is.
bool numbersFit(const nlohmann::json& e) {
  for (auto it = e.begin(); it != e.end(); ++it) {
    const bool wide = it.key() == "pid" || it.key() == "step" || it.key() == "repeated";
    const double limit = it.key() == "t" ? 1e300 : wide ? 9007199254740992.0 : 2147483647.0;
    const auto fits = [limit](const nlohmann::json& v) {
      if (!v.is_number()) {
        return true;  // a wrong type is the reader's type_error, caught per line
      }
      if (v.is_number_unsigned()) {
        return static_cast<double>(v.get<uint64_t>()) <= limit;
      }
      const double d = v.get<double>();
      return std::isfinite(d) && d <= limit && d >= -limit;
    };
    if (it->is_array()) {
      for (const auto& v : *it) {
        if (!fits(v)) {
          return false;
        }
      }
    } else if (!fits(*it)) {
      return false;
    }
  }
  return true;
}

using json = nlohmann::json;

std::string fixed(double v, int digits = 1) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.*f", digits, v);
  return b;
}

std::string slotList(const std::vector<int>& slots) {
  std::string s;
  for (int v : slots) {
    s += (s.empty() ? "" : ",") + std::to_string(v);
  }
  return s;
}

Generation* generationOf(Job& job, int number) {
  for (auto& g : job.generations) {
    if (g.number == number) {
      return &g;
    }
  }
  return nullptr;
}

}  // namespace

double unixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

namespace {

std::string jobRecordPath(const std::string& dir) { return dir + "/" + protocol::kJobRecordFile; }

// One line of the record, newline included.
std::string eventLine(const std::string& event, int generation, const nlohmann::json& fields) {
  json line = {
      {"t", std::round(unixNow() * 1000) / 1000}, {"event", event}, {"generation", generation}};
  for (auto it = fields.begin(); it != fields.end(); ++it) {
    line[it.key()] = it.value();
  }
  return line.dump() + "\n";
}

}  // namespace

void append(const std::string& dir, const std::string& event, int generation,
            const nlohmann::json& fields) {
  const std::string text = eventLine(event, generation, fields);
  const int fd =
      ::open(jobRecordPath(dir).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd >= 0) {
    (void)!::write(fd, text.data(), text.size());
    ::close(fd);
  }
}

Writer::~Writer() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void Writer::open(const std::string& dir, int generation) {
  if (fd_ < 0 && !dir.empty()) {
    fd_ = ::open(jobRecordPath(dir).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
  generation_ = generation;
}

void Writer::add(const std::string& event, const nlohmann::json& fields) {
  if (fd_ >= 0) {
    const std::string text = eventLine(event, generation_, fields);
    (void)!::write(fd_, text.data(), text.size());  // a record for people, not a commit
  }
}

static void readEvent(const json& e, Job& job, double& lastEnd, std::string& lastEndText);

Job read(const std::string& dir) {
  const std::string path = jobRecordPath(dir);
  std::ifstream in(path);
  if (!in) {
    throw std::runtime_error("cannot read " + path +
                             ": not an elastic job's folder (hddp-run --nproc-per-node MIN:MAX "
                             "names it in its first lines; --job-dir keeps it after the job)");
  }
  Job job;
  double lastEnd = -1;  // what ended the newest generation: its first unplug or departure
  std::string lastEndText;
  std::string line;
  while (std::getline(in, line)) {
    json e = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!e.is_object() || !e.contains("event") || !e.contains("t") || !numbersFit(e)) {
      ++job.skippedLines;
      continue;
    }
    try {
      readEvent(e, job, lastEnd, lastEndText);
    } catch (const json::exception&) {
      ++job.skippedLines;  // a field of another type than the record's (a number for a name)
    }
  }
  if (job.start < 0) {
    throw std::runtime_error(path + " has no \"job\" event: not written by hddp-run");
  }
  return job;
}

// One event of the record applied to `job` (json::exception for a field of a wrong type).
static void readEvent(const json& e, Job& job, double& lastEnd, std::string& lastEndText) {
  {
    const std::string event = e.value("event", "");
    const double t = e.value("t", 0.0);
    const int gen = e.value("generation", 0);
    if (event == "job") {
      job.start = t;
      job.minRanks = e.value("min", 0);
      job.maxRanks = e.value("max", 0);
      job.pid = e.value("pid", 0L);
    } else if (event == "generation") {
      Generation g;
      g.number = gen;
      g.start = t;
      g.slots = e.value("slots", std::vector<int>{});
      g.cause = gen > 0 ? lastEnd : -1;
      g.causeText = lastEndText;
      job.generations.push_back(g);
      lastEnd = -1;
      lastEndText.clear();
    } else if (event == "unplug" || event == "left") {
      const int slot = e.value("slot", -1);
      if (lastEnd < 0) {
        lastEnd = t;
        lastEndText = "slot " + std::to_string(slot) + (event == "unplug" ? " unplugged" : " left");
      }
      if (event == "left") {
        job.departures.push_back({slot, gen, t, e.value("why", ""), -1});
      }
    } else if (event == "back") {
      for (int slot : e.value("slots", std::vector<int>{})) {
        for (auto& d : job.departures) {
          if (d.slot == slot && d.back < 0) {
            d.back = t;
          }
        }
      }
    } else if (event == "reform") {
      if (lastEnd < 0) {
        lastEnd = t;
        lastEndText = "the ranks left to re-form";
      }
    } else if (event == "started" || event == "resumed") {
      if (Generation* g = generationOf(job, gen)) {
        g->resumedStep = e.value("step", int64_t{0});
        g->repeated = e.value("repeated", int64_t{0});
        g->commits = e.value("commits", "");
      }
    } else if (event == "first_step") {
      if (Generation* g = generationOf(job, gen)) {
        g->firstStep = t;
      }
    } else if (event == "commit") {
      job.commitStep = e.value("step", int64_t{-1});
      job.commitAt = t;
      job.commitFile = e.value("file", "");
    } else if (event == "end") {
      job.ended = true;
      job.endAt = t;
      job.exitCode = e.value("code", 0);
      job.endWhy = e.value("why", "");
    }
  }
}

int64_t repeatedSteps(const Job& job) {
  int64_t n = 0;
  for (const auto& g : job.generations) {
    n += g.repeated;
  }
  return n;
}

double reformSeconds(const Generation& g) {
  return g.number > 0 && g.cause >= 0 && g.firstStep >= 0 ? g.firstStep - g.cause : -1;
}

std::vector<std::string> describe(const Job& job, double now) {
  std::vector<std::string> out;
  const auto at = [&](double t) { return fixed(t - job.start) + " s"; };
  out.push_back("elastic job of " + std::to_string(job.minRanks) + " to " +
                std::to_string(job.maxRanks) + " ranks (hddp-run pid " + std::to_string(job.pid) +
                ")");
  // Events in time order: generations and departures interleave.
  struct Line {
    double t;
    int order;  // at the same millisecond: what ended a generation before the next one
    std::string text;
  };
  std::vector<Line> lines;
  for (const auto& g : job.generations) {
    std::string text = "generation " + std::to_string(g.number) + ": " +
                       std::to_string(g.slots.size()) + " rank(s) on slots " + slotList(g.slots);
    if (g.resumedStep >= 0 && g.number > 0) {
      text += "; resumed at step " + std::to_string(g.resumedStep) + ", " +
              (g.repeated > 0 ? std::to_string(g.repeated) + " step(s) trained again"
                              : "no step trained again");
    }
    const double reform = reformSeconds(g);
    if (reform >= 0) {
      text += "; first step " + fixed(reform) + " s after " + g.causeText;
    } else if (g.number > 0 && g.firstStep < 0) {
      text += "; no step yet";
    }
    lines.push_back({g.start, 1, text});
  }
  for (const auto& d : job.departures) {
    lines.push_back({d.at, 0, "slot " + std::to_string(d.slot) + " left: " + d.why});
    if (d.back >= 0) {
      lines.push_back({d.back, 0,
                       "slot " + std::to_string(d.slot) + " can run again (away " +
                           fixed(d.back - d.at) + " s)"});
    }
  }
  std::stable_sort(lines.begin(), lines.end(), [](const Line& a, const Line& b) {
    return a.t < b.t || (a.t == b.t && a.order < b.order);
  });
  for (const auto& l : lines) {
    out.push_back("  " + at(l.t) + "  " + l.text);
  }
  if (job.commitStep >= 0) {
    out.push_back(
        "newest commit: step " + std::to_string(job.commitStep) + " at " + at(job.commitAt) +
        (job.ended ? "" : " (" + fixed(now - job.commitAt) + " s ago)") + ", " + job.commitFile);
  }
  int reforms = 0;
  double reformSum = 0, reformMax = 0;
  for (const auto& g : job.generations) {
    const double r = reformSeconds(g);
    if (r >= 0) {
      ++reforms;
      reformSum += r;
      reformMax = std::max(reformMax, r);
    }
  }
  std::string total = std::to_string(job.generations.size()) + " generation(s), " +
                      std::to_string(job.departures.size()) + " departure(s), " +
                      std::to_string(repeatedSteps(job)) + " step(s) trained again";
  if (reforms > 0) {
    total += ", re-forming " + fixed(reformSum / reforms) + " s on average (longest " +
             fixed(reformMax) + " s)";
  }
  if (job.ended) {
    out.push_back("ended at " + at(job.endAt) + " with exit code " + std::to_string(job.exitCode) +
                  (job.endWhy.empty() ? "" : ": " + job.endWhy) + "; " + total);
  } else {
    out.push_back("running for " + fixed(now - job.start) + " s; " + total);
  }
  if (job.skippedLines > 0) {
    out.push_back("(" + std::to_string(job.skippedLines) + " line(s) of the record did not parse)");
  }
  return out;
}

nlohmann::json toJson(const Job& job) {
  json gens = json::array();
  for (const auto& g : job.generations) {
    gens.push_back({{"generation", g.number},
                    {"start_s", g.start - job.start},
                    {"slots", g.slots},
                    {"resumed_step", g.resumedStep},
                    {"repeated_steps", g.repeated},
                    {"reform_s", reformSeconds(g)},
                    {"commits", g.commits}});
  }
  json deps = json::array();
  for (const auto& d : job.departures) {
    deps.push_back({{"slot", d.slot},
                    {"generation", d.generation},
                    {"left_s", d.at - job.start},
                    {"why", d.why},
                    {"back_s", d.back >= 0 ? json(d.back - job.start) : json(nullptr)}});
  }
  json j = {{"min_ranks", job.minRanks},
            {"max_ranks", job.maxRanks},
            {"launcher_pid", job.pid},
            {"generations", gens},
            {"departures", deps},
            {"repeated_steps", repeatedSteps(job)},
            {"newest_commit_step", job.commitStep},
            {"ended", job.ended}};
  if (job.ended) {
    j["exit_code"] = job.exitCode;
    j["end_s"] = job.endAt - job.start;
  }
  return j;
}

}  // namespace jobrecord
}  // namespace hddp
