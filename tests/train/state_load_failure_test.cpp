// Loads of a Trainer state file that fail, and what they leave: a damaged or incomplete
// file changes nothing on any rank (everything is read and checked before anything is
// applied); a load that fails after it began to apply leaves the Trainer refusing to go
// on; running out of memory is reported as itself, never as a damaged file, by the load
// and by the choice of a commit among the ranks' folders (src/train/commit_folders.cpp);
// and the planner's part of a file refuses counts of ranks that do not fit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "hddp/hddp.h"
#include "support/mlp_job.h"
#include "support/ranks.h"
#include "train/commit_folders.h"
#include "train/state_file_seam.h"

namespace fs = std::filesystem;
using hddp::testing::runThreads;

namespace {

// SGD whose load() first runs `onLoad` (a fault injected into the load of one rank).
class InjectingSgd : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  std::function<void()> onLoad;
  void load(torch::serialize::InputArchive& archive) override {
    if (onLoad) {
      onLoad();
    }
    torch::optim::SGD::load(archive);
  }
};

// One rank's job (tests/support/mlp_job.h), its optimizer instrumented.
using Job = hddp::testing::MlpJob<InjectingSgd>;

// A folder holding the state file of step 3 of a two-rank run (with the planner).
std::string savedRun() {
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    Job job(rank, size, store, dir, /*maxSteps=*/3);
    job.trainer->fit();
  });
  return dir;
}

// `from` copied into `to`, entry by entry (archives inside too), `edit` deciding each
// tensor, named by its path ("meta", "scaler/scale"): it returns the tensor to write, or
// an undefined one to leave it out.
void copyArchive(torch::serialize::InputArchive& from, torch::serialize::OutputArchive& to,
                 const std::function<at::Tensor(const std::string&, const at::Tensor&)>& edit) {
  for (const auto& key : from.keys()) {
    torch::serialize::InputArchive inner;
    at::Tensor t;
    if (from.try_read(key, inner)) {
      torch::serialize::OutputArchive out;
      copyArchive(inner, out, [&edit, &key](const std::string& k, const at::Tensor& x) {
        return edit(key + "/" + k, x);  // an inner entry by its path: "scaler/scale"
      });
      to.write(key, out);
    } else if (from.try_read(key, t)) {
      const at::Tensor edited = edit(key, t);
      if (edited.defined()) {
        to.write(key, edited);
      }
    } else {
      c10::IValue v;
      from.read(key, v);
      to.write(key, v);
    }
  }
}

// The state file `path` written again into `dir` as step 9 with its tensors edited.
std::string editedStateFile(
    const std::string& path, const std::string& dir,
    const std::function<at::Tensor(const std::string&, const at::Tensor&)>& edit) {
  const std::string payload = hddp::readStateFile(path);
  torch::serialize::InputArchive in;
  in.load_from(payload.data(), payload.size());
  torch::serialize::OutputArchive out;
  copyArchive(in, out, edit);
  std::ostringstream bytes;
  out.save_to(bytes);
  const std::string edited = hddp::stateFileName(dir, 9);
  hddp::writeStateFile(edited, bytes.str());
  return edited;
}

void expectSame(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << what << ": parameter " << i << " changed";
  }
}

// Two ranks load `file`: each is refused with a StateError that names `named`, keeps its
// parameters and step, and then trains its 2 steps, alike (nothing half loaded).
void expectRefusedAndUnchangedOnEveryRank(const std::string& file, const std::string& named) {
  std::vector<std::string> errors(2);
  std::vector<int64_t> steps(2, -1);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    Job job(rank, size, store, "", /*maxSteps=*/2);
    const auto before = job.parameters();
    try {
      job.trainer->load(file);
    } catch (const hddp::StateError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
    expectSame(before, job.parameters(), "a refused load");
    EXPECT_EQ(job.trainer->step(), 0);
    steps[static_cast<size_t>(rank)] = job.trainer->fit().totalSteps;  // goes on, alike
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find(named), std::string::npos) << e;
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 2}));
}

}  // namespace

// A file that names 4 saving ranks but holds the parts of 2: refused on every rank with a
// StateError before anything is copied in, so each rank's Trainer is as it was and trains
// on alike (before, the model and optimizer were copied first).
TEST(StateLoadFailure, AFileMissingARanksPartChangesNothingOnAnyRank) {
  const std::string saved = savedRun();
  const std::string dir = hddp::testing::makeTempDir();
  const std::string file = editedStateFile(
      hddp::listStateFiles(saved).back(), dir, [](const std::string& key, const at::Tensor& t) {
        if (key != "meta") {
          return t;
        }
        at::Tensor meta = t.clone();
        meta[4] = 4;  // worldSize: parts rank2 and rank3 are missing
        return meta;
      });
  expectRefusedAndUnchangedOnEveryRank(file, "rank2");
}

// A scaler entry missing from the file (found by review: checked only while applied, so
// the model and RNGs were already changed and the Trainer was left half loaded): refused
// with a StateError before anything changes, and every rank trains on alike.
TEST(StateLoadFailure, ADamagedScalerEntryChangesNothingOnAnyRank) {
  const std::string saved = savedRun();
  const std::string dir = hddp::testing::makeTempDir();
  const std::string file = editedStateFile(
      hddp::listStateFiles(saved).back(), dir, [](const std::string& key, const at::Tensor& t) {
        return key == "scaler/growth_interval" ? at::Tensor() : t;
      });
  expectRefusedAndUnchangedOnEveryRank(file, "growth_interval");
}

// The optimizer's own load refuses its entries on rank 1 only, after the model was copied
// in: every rank learns it, and every rank's Trainer then refuses fit(), save() and
// load() with a message that says to construct a new one (before, rank 0 trained on from
// the file and rank 1 from half of it).
TEST(StateLoadFailure, ALoadThatFailsPartWayLeavesTheTrainerRefusingOnEveryRank) {
  const std::string saved = savedRun();
  const std::string file = hddp::listStateFiles(saved).back();
  std::vector<std::string> loadErrors(2), fitErrors(2), saveErrors(2), againErrors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    Job job(rank, size, store, hddp::testing::makeTempDir(), /*maxSteps=*/5);
    if (rank == 1) {
      job.optimizer->onLoad = [] { TORCH_CHECK(false, "injected: the optimizer refuses"); };
    }
    auto message = [](const std::function<void()>& call) -> std::string {
      try {
        call();
      } catch (const c10::Error& e) {
        return e.what_without_backtrace();
      }
      return "";
    };
    const size_t r = static_cast<size_t>(rank);
    loadErrors[r] = message([&] { job.trainer->load(file); });
    fitErrors[r] = message([&] { job.trainer->fit(); });
    saveErrors[r] = message([&] { job.trainer->save(); });
    againErrors[r] = message([&] { job.trainer->load(file); });
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_NE(loadErrors[r].find("the optimizer refuses"), std::string::npos) << loadErrors[r];
    for (const auto* e : {&fitErrors[r], &saveErrors[r], &againErrors[r]}) {
      EXPECT_NE(e->find("failed to load part-way"), std::string::npos)
          << "rank " << r << ": " << *e;
      EXPECT_NE(e->find("construct a new Trainer"), std::string::npos) << *e;
    }
  }
}

// Rank 1 runs out of memory while its optimizer loads (c10::OutOfMemoryError, as
// LibTorch's CPU and CUDA allocators throw it): rank 1 sees that error as it is and rank
// 0 an hddp::Error naming it, neither a StateError calling the good file damaged.
TEST(StateLoadFailure, OutOfMemoryDuringALoadIsReportedAsItselfNotAsADamagedFile) {
  const std::string saved = savedRun();
  const std::string file = hddp::listStateFiles(saved).back();
  std::vector<std::string> errors(2);
  std::vector<bool> outOfMemory(2, false), stateError(2, false);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    Job job(rank, size, store, "", /*maxSteps=*/5);
    if (rank == 1) {
      job.optimizer->onLoad = [] {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "injected: out of memory (tried 1 GiB)");
      };
    }
    const size_t r = static_cast<size_t>(rank);
    try {
      job.trainer->load(file);
    } catch (const c10::OutOfMemoryError& e) {
      outOfMemory[r] = true;
      errors[r] = e.what_without_backtrace();
    } catch (const hddp::StateError& e) {
      stateError[r] = true;
      errors[r] = e.what_without_backtrace();
    } catch (const c10::Error& e) {
      errors[r] = e.what_without_backtrace();
    }
  });
  EXPECT_TRUE(outOfMemory[1]) << errors[1];
  EXPECT_FALSE(stateError[0]) << errors[0];
  EXPECT_FALSE(stateError[1]) << errors[1];
  for (const auto& e : errors) {
    EXPECT_NE(e.find("out of memory"), std::string::npos) << e;
    EXPECT_EQ(e.find("damaged"), std::string::npos) << e;
  }
  EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
}

// The choice of a commit among folders of their own: rank 1 runs out of memory while it
// reads its folder's file. That is no damaged file to pass over for rank 0's copy: every
// rank fails, saying so (before, rank 1 skipped its file with a warning and the run went
// on from rank 0's).
TEST(StateLoadFailure, OutOfMemoryWhileChoosingACommitFailsEveryRank) {
  const std::string root = hddp::testing::makeTempDir();
  for (const char* dir : {"/a", "/b"}) {
    hddp::writeStateFile(hddp::stateFileName(root + dir, 3), "the commit of step 3");
  }
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    const auto groups = hddp::train::folderGroups(*comm, root + (rank == 0 ? "/a" : "/b"));
    const auto accept = [rank](const std::string&) -> bool {
      if (rank == 1) {
        throw std::bad_alloc();
      }
      return true;
    };
    try {
      hddp::train::chooseCommit(*comm, groups, accept, /*keep=*/true);
    } catch (const std::exception& e) {
      const auto* c10 = dynamic_cast<const c10::Error*>(&e);
      errors[static_cast<size_t>(rank)] = c10 ? c10->what_without_backtrace() : e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 1 ran out of memory"), std::string::npos) << e;
  }
}

// The commit sent to a folder without it, where keeping the copy fails on rank 1 with an
// exception that is no c10::Error (out of memory; the file system's own): every rank
// learns it in the allgather after the transfer, at once, instead of rank 0 waiting there
// for rank 1 until the communicator's timeout.
TEST(StateLoadFailure, AFailureKeepingAReceivedCommitFailsEveryRankAtOnce) {
  struct Case {
    hddp::detail::StateWriteHook hook;
    const char* said;
  };
  const std::vector<Case> cases = {
      {[](int, const std::string&, const std::string&) { throw std::bad_alloc(); },
       "rank 1 ran out of memory"},
      {[](int, const std::string& tmp, const std::string&) {
         throw fs::filesystem_error("injected", tmp, std::make_error_code(std::errc::io_error));
       },
       "injected"}};
  for (const auto& c : cases) {
    const std::string root = hddp::testing::makeTempDir();
    hddp::writeStateFile(hddp::stateFileName(root + "/a", 3), "the commit of step 3");
    fs::create_directories(root + "/b");
    std::vector<std::string> errors(2);
    std::vector<double> seconds(2, 0);
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      hddp::CommunicatorOptions o;
      o.timeout = std::chrono::seconds(30);
      auto comm = hddp::makeCommunicator(store, rank, size, o);
      const auto groups = hddp::train::folderGroups(*comm, root + (rank == 0 ? "/a" : "/b"));
      comm->barrier();
      if (rank == 1) {  // only rank 1 writes from here on (the copy it receives)
        hddp::detail::setStateWriteHook(c.hook);
      }
      const auto t0 = std::chrono::steady_clock::now();
      try {
        hddp::train::chooseCommit(*comm, groups, nullptr, /*keep=*/true);
      } catch (const std::exception& e) {
        const auto* c10 = dynamic_cast<const c10::Error*>(&e);
        errors[static_cast<size_t>(rank)] = c10 ? c10->what_without_backtrace() : e.what();
      }
      seconds[static_cast<size_t>(rank)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
    hddp::detail::setStateWriteHook(nullptr);
    for (size_t r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find(c.said), std::string::npos) << "rank " << r << ": " << errors[r];
      EXPECT_EQ(errors[r].find("timed out"), std::string::npos) << errors[r];
    }
  }
}

namespace {

// A planner's archives as save() writes them, for a job of `ranks` ranks and global batch
// 8, with `costRows` rows of costs, `caps` caps and a window of `windowColumns` columns.
void plannerArchives(int64_t ranks, int64_t costRows, int64_t caps, int64_t windowColumns,
                     torch::serialize::InputArchive& shared, torch::serialize::InputArchive& own) {
  torch::serialize::OutputArchive s;
  torch::serialize::OutputArchive o;
  std::vector<int64_t> plan(static_cast<size_t>(ranks), 0);
  plan[0] = 8;
  s.write("plan", at::tensor(plan, at::kLong));
  s.write("step", at::tensor(std::vector<int64_t>{4}, at::kLong));
  s.write("costs", at::full({costRows, 5}, 0.01, at::kDouble));
  s.write("caps", at::full({caps}, -1, at::kLong));
  o.write("window", at::ones({3, windowColumns}, at::kDouble));
  for (auto [out, in] : {std::make_pair(&s, &shared), std::make_pair(&o, &own)}) {
    std::ostringstream bytes;
    out->save_to(bytes);
    const std::string b = bytes.str();
    in->load_from(b.data(), b.size());
  }
}

}  // namespace

// The planner's part of a state file saved for another number of ranks than its plan,
// costs and caps say: a StateError (a damaged file), not a ConfigError or costs silently
// resized; and a malformed window is refused by loadRemapped as load() refuses it.
TEST(StateLoadFailure, PlannerEntriesForAnotherNumberOfRanksAreStateErrors) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::PlannerOptions options(8);
    hddp::BatchPlanner planner(*comm, options);
    const auto refusal = [&](int64_t ranks, int64_t costRows, int64_t caps, int64_t columns,
                             bool remapped) -> std::string {
      torch::serialize::InputArchive shared;
      torch::serialize::InputArchive own;
      plannerArchives(ranks, costRows, caps, columns, shared, own);
      try {
        if (remapped) {
          planner.loadRemapped(shared, &own, {0});
        } else {
          planner.load(shared, own);
        }
      } catch (const hddp::StateError& e) {
        return e.what_without_backtrace();
      } catch (const c10::Error& e) {
        return std::string("not a StateError: ") + e.what_without_backtrace();
      }
      return "loaded";
    };
    EXPECT_EQ(refusal(1, 1, 1, 5, false), "loaded");
    EXPECT_EQ(refusal(1, 0, 0, 5, false), "loaded") << "a planner saved before any cost";
    EXPECT_EQ(refusal(2, 2, 2, 5, true), "loaded") << "saved by 2 ranks, remapped into 1";
    EXPECT_NE(refusal(1, 3, 3, 5, false).find("costs are for 3 ranks, not 1"), std::string::npos)
        << refusal(1, 3, 3, 5, false);
    EXPECT_NE(refusal(1, 1, 4, 5, false).find("4 memory caps for 1"), std::string::npos)
        << refusal(1, 1, 4, 5, false);
    EXPECT_NE(refusal(2, 2, 2, 5, false).find("plan is for 2 ranks, not 1"), std::string::npos)
        << refusal(2, 2, 2, 5, false);
    EXPECT_NE(refusal(2, 2, 2, 4, true).find("measurement window has shape"), std::string::npos)
        << refusal(2, 2, 2, 4, true);
  });
}
