// The C++ side of the differential matrix against PyTorch (tools/diff-matrix/matrix.py,
// docs/reliability.md): trains each case folder's configuration on N ranks (threads of
// this process over an in-memory store, Gloo on the CPU) in float64 (float32 under bf16
// autocast) with hddp::DistributedDataParallel (setBatch(local, global) every micro-step,
// noSync() micro-steps, a rank without samples calling finalize()) and an optional
// hddp::ShardedOptimizer, and writes each rank's final state for the reference to read.
// A case with "resume" trains its first steps on N ranks, saves the state, and goes on
// from the saved state on M fresh ranks (diff_matrix_rank.cpp).
//
//   diff_matrix CASE_DIR...
//
// Reads CASE_DIR/case.json and CASE_DIR/data.safetensors (tools/diff-matrix/cases.py
// says what they hold); writes CASE_DIR/out/rank<r>.safetensors with `param/<name>` (a
// tied tensor under each of its names), `buffer/<name>` and `state/<name>/<key>` (the
// optimizer state this rank holds: momentum_buffer; step, exp_avg, exp_avg_sq,
// max_exp_avg_sq), CASE_DIR/out/layout.json (the buckets and ZeRO shards of each step),
// or CASE_DIR/out/error.txt when a rank threw. Exit code 1 when any case failed to run
// (a disagreement with the reference is matrix.py's to find).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "diff_matrix_rank.h"
#include "hddp/hddp.h"

namespace {

using json = nlohmann::json;
using diff_matrix::Phase;
using diff_matrix::RankResult;
using diff_matrix::Tensors;

std::string readText(const std::string& path) {
  std::ifstream in(path);
  HDDP_CHECK(in.good(), "cannot read ", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Removes the files of `folder` (creating it if need be).
void clearFolder(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  fs::create_directories(folder);
  for (const auto& entry : fs::directory_iterator(folder)) {
    fs::remove(entry.path());  // not fs::remove_all: it resolves to libtorch's copy, which crashes
  }
}

// Runs `size` ranks of one phase as threads; `errors` gets each rank's error ("" if none)
// with `label` in front.
std::vector<RankResult> runPhase(const json& cfg, const Tensors& data, int size, const Phase& phase,
                                 const std::string& label, std::vector<std::string>& errors) {
  hddp::Store store = hddp::Store::memory(std::chrono::seconds(60));
  std::vector<RankResult> results(size);
  std::vector<std::string> mine(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        hddp::Store handle = store;
        results[r] = diff_matrix::runRank(cfg, data, r, size, handle, phase);
      } catch (const c10::Error& e) {
        mine[r] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        mine[r] = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int r = 0; r < size; ++r) {
    if (!mine[r].empty()) {
      errors.push_back(label + "rank " + std::to_string(r) + ": " + mine[r]);
    }
  }
  return results;
}

// Runs one case folder; returns false when a rank threw (error.txt says why).
bool runCase(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path outDir = fs::path(dir) / "out";
  clearFolder(outDir);
  std::vector<std::string> errors;
  try {
    const json cfg = json::parse(readText((fs::path(dir) / "case.json").string()));
    const Tensors data = hddp::readStateDict((fs::path(dir) / "data.safetensors").string());
    const int size = cfg.at("world");
    const size_t steps = cfg.at("splits").size();
    json layout = json::array();
    std::vector<RankResult> results;
    if (cfg.at("resume").is_null()) {
      results = runPhase(cfg, data, size, Phase{0, steps, "", "", 0}, "", errors);
    } else {
      // Save after step `at` on N ranks; M fresh ranks load and go on.
      const fs::path stateDir = fs::path(dir) / "state";
      clearFolder(stateDir);
      const size_t at = cfg.at("resume").at("at");
      const int later = cfg.at("resume").at("world");
      auto first = runPhase(cfg, data, size, Phase{0, at, stateDir.string(), "", 0},
                            "before the save: ", errors);
      if (errors.empty()) {
        layout = first[0].layout;
        results = runPhase(cfg, data, later, Phase{at, steps, "", stateDir.string(), size},
                           "after the resume: ", errors);
      }
    }
    if (errors.empty()) {
      for (const auto& step : results[0].layout) {
        layout.push_back(step);
      }
      std::ofstream((outDir / "layout.json").string()) << layout.dump();
      for (size_t r = 0; r < results.size(); ++r) {
        hddp::writeStateDict(results[r].tensors,
                             (outDir / ("rank" + std::to_string(r) + ".safetensors")).string());
      }
    }
  } catch (const c10::Error& e) {
    errors.push_back(std::string("case: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    errors.push_back(std::string("case: ") + e.what());
  }
  std::string message;
  for (const auto& e : errors) {
    message += e + "\n";
  }
  if (!message.empty()) {
    std::ofstream((outDir / "error.txt").string()) << message;
    std::fprintf(stderr, "%s: %s", dir.c_str(), message.c_str());
  }
  return message.empty();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    std::printf(
        "usage: diff_matrix CASE_DIR...\n(tools/diff-matrix/matrix.py makes the case "
        "folders and runs this; docs/reliability.md)\n");
    return argc < 2 ? 2 : 0;
  }
  at::set_num_threads(1);  // ranks are threads already; the float64 sums stay in one order
  int failed = 0;
  for (int i = 1; i < argc; ++i) {
    failed += runCase(argv[i]) ? 0 : 1;
  }
  return failed > 0 ? 1 : 0;
}
