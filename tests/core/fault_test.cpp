// Faults on purpose (hddp/core/fault.h, issue #49 part 4): HDDP_FAULT's grammar, its
// errors, its filters, and the Trainer surviving what it injects: a full disk at a save
// (the run fails on every rank, nothing half-written stays, the previous commit resumes)
// and a truncated newest commit (the one before it resumes, with a warning).
#include "hddp/core/fault.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/comm/store.h"
#include "hddp/core/error.h"
#include "hddp/train/state_file.h"
#include "support/ranks.h"
#include "support/scoped_env.h"
#include "support/trainer_runs.h"

namespace fs = std::filesystem;

namespace {

std::string configError(const std::string& text) {
  try {
    hddp::fault::parse(text);
  } catch (const hddp::ConfigError& e) {
    return e.what_without_backtrace();
  }
  return "(no ConfigError)";
}

TEST(Fault, ParsesEntriesWithTheirFilters) {
  const auto faults =
      hddp::fault::parse("kill@step=5,rank=1; nospace@save=2 ;slow=0.5@step=3,restart=*;");
  ASSERT_EQ(faults.size(), 3u);
  EXPECT_EQ(faults[0].kind, hddp::fault::Kind::Kill);
  EXPECT_EQ(faults[0].point, hddp::fault::Point::Step);
  EXPECT_EQ(faults[0].at, 5);
  EXPECT_EQ(faults[0].rank, 1);
  EXPECT_EQ(faults[0].slot, -1);
  EXPECT_EQ(faults[0].restart, 0) << "the first attempt only, unless restart= says otherwise";
  EXPECT_EQ(faults[1].kind, hddp::fault::Kind::NoSpace);
  EXPECT_EQ(faults[1].point, hddp::fault::Point::Save);
  EXPECT_EQ(faults[1].rank, -1);
  EXPECT_EQ(faults[2].kind, hddp::fault::Kind::Slow);
  EXPECT_DOUBLE_EQ(faults[2].seconds, 0.5);
  EXPECT_EQ(faults[2].restart, -1);
  EXPECT_TRUE(hddp::fault::parse("").empty());
}

TEST(Fault, ABadEntryIsAConfigErrorThatSaysWhatIsWrong) {
  EXPECT_NE(configError("boom@step=1").find("entry 'boom@step=1': unknown kind 'boom'"),
            std::string::npos);
  EXPECT_NE(configError("kill step=1").find("no '@'"), std::string::npos);
  EXPECT_NE(configError("kill@step").find("'step' is not NAME=VALUE"), std::string::npos);
  EXPECT_NE(configError("kill@epoch=2").find("unknown point 'epoch'"), std::string::npos);
  EXPECT_EQ(hddp::fault::parse("hang@collective=7,rank=2")[0].point,
            hddp::fault::Point::Collective);
  EXPECT_NE(configError("kill@step=0").find("points count from 1"), std::string::npos);
  EXPECT_NE(configError("kill@step=x").find("'x' is not a non-negative integer"),
            std::string::npos);
  EXPECT_NE(configError("nospace@step=2").find("nospace applies to save only"), std::string::npos);
  EXPECT_NE(configError("slow=abc@step=2").find("slow's seconds"), std::string::npos);
  EXPECT_NE(
      configError("raise@step=2,node=1").find("unknown filter 'node' (rank, slot or restart)"),
      std::string::npos);
  EXPECT_NE(configError("raise@step=2").find("(no ConfigError)"), std::string::npos);
}

// A fault acts on its rank, in its attempt, at its count, once.
TEST(Fault, ActsOnItsRankAndAttemptAtItsCountOnce) {
  hddp::testing::ScopedEnv fault("HDDP_FAULT", "raise@step=2,rank=0");
  hddp::fault::arm(/*rank=*/1, /*restart=*/0);
  EXPECT_NO_THROW(hddp::fault::at(hddp::fault::Point::Step, 2)) << "another rank";
  hddp::fault::arm(0, 1);
  EXPECT_NO_THROW(hddp::fault::at(hddp::fault::Point::Step, 2)) << "a restarted job";
  {
    hddp::testing::ScopedEnv slotted("HDDP_FAULT", "raise@step=2,slot=3");
    hddp::fault::arm(0, 0, /*slot=*/2);
    EXPECT_NO_THROW(hddp::fault::at(hddp::fault::Point::Step, 2)) << "another slot";
    hddp::fault::arm(1, 0, /*slot=*/3);
    EXPECT_THROW(hddp::fault::at(hddp::fault::Point::Step, 2), hddp::Error) << "its slot";
  }
  hddp::fault::arm(0, 0);
  EXPECT_NO_THROW(hddp::fault::at(hddp::fault::Point::Step, 1));
  try {
    hddp::fault::at(hddp::fault::Point::Step, 2);
    ADD_FAILURE() << "no fault at step 2";
  } catch (const hddp::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("fault injected by HDDP_FAULT ('raise@step=2,rank=0') at step 2 on rank 0"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_NO_THROW(hddp::fault::at(hddp::fault::Point::Step, 2)) << "a fault acts once";
  hddp::fault::disarm();
}

// collective=N counts each rank's launches on any thread (DDP's buckets launch from the
// autograd thread): rank 1's second collective, launched from a thread of its own, fails
// with a DistributedError and sends nothing, so the next pair still meets.
TEST(Fault, ACollectiveFaultFailsItsLaunchOnItsRankAndSendsNothing) {
  hddp::testing::ScopedEnv fault("HDDP_FAULT", "raise@collective=2,rank=1");
  std::vector<double> sums(2, 0);
  std::string error;
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::fault::arm(rank, /*restart=*/0);
    at::Tensor t = at::full({3}, rank + 1.0, at::kDouble);
    comm->allreduce(t).wait();  // collective 1: 1 + 2
    if (rank == 1) {
      std::thread other([&] {
        at::Tensor lost = at::ones({3}, at::kDouble);
        try {
          comm->allreduce(lost).wait();  // collective 2 of rank 1: fails
        } catch (const hddp::DistributedError& e) {
          error = e.what_without_backtrace();
        }
      });
      other.join();
    }
    comm->allreduce(t).wait();  // 3 + 3: nothing of the failed one arrived
    sums[static_cast<size_t>(rank)] = t[0].item<double>();
    hddp::fault::disarm();
  });
  EXPECT_NE(error.find("collective failed: fault injected by HDDP_FAULT "
                       "('raise@collective=2,rank=1') at collective 2 (allreduce"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("on rank 1/2) on rank 1; nothing was sent"), std::string::npos) << error;
  EXPECT_EQ(sums[0], 6.0);
  EXPECT_EQ(sums[1], 6.0);
}

// drop@store=N: the connection to the store drops at the N-th operation; that one and
// every later one fail with a StoreError, on a store made from it by withPrefix too.
TEST(Fault, ADroppedStoreFailsItsOperationsFromThenOn) {
  auto fault = std::make_unique<hddp::testing::ScopedEnv>("HDDP_FAULT", "drop@store=3,rank=1");
  hddp::fault::armStore(/*rank=*/0, /*restart=*/0);
  auto other = hddp::Store::memory();
  other.set("a", std::string("1"));
  other.set("b", std::string("2"));
  EXPECT_EQ(other.getString("a"), "1") << "another rank's store does not drop";
  hddp::fault::armStore(1, 0);
  auto store = hddp::Store::memory();
  auto prefixed = store.withPrefix("p/");
  store.set("a", std::string("1"));
  EXPECT_EQ(store.getString("a"), "1");
  std::string error;
  try {
    store.add("n", 1);
    ADD_FAILURE() << "the third operation did not fail";
  } catch (const hddp::StoreError& e) {
    error = e.what_without_backtrace();
  }
  EXPECT_NE(error.find("store add('n') on in-memory store failed: the connection to the store "
                       "dropped (fault injected by HDDP_FAULT)"),
            std::string::npos)
      << error;
  EXPECT_THROW(store.getString("a"), hddp::StoreError) << "a dropped store stays dropped";
  EXPECT_THROW(prefixed.set("x", std::string("1")), hddp::StoreError);
  EXPECT_NE(configError("drop@step=3").find("drop applies to store only"), std::string::npos);
  fault.reset();
  hddp::fault::armStore(1, 0);  // HDDP_FAULT unset: nothing armed on this thread
}

hddp::TrainSummary run(int rank, int size, hddp::Store& store, const std::string& dir,
                       int64_t maxSteps, bool resume = false) {
  return hddp::testing::trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
    o.saveDir = dir;
    o.resume = resume ? dir : "";
    o.saveEvery = 2;
    o.keepLast = 10;
    o.maxSteps = maxSteps;
    o.loader.workers = 0;
  });
}

// A fit() that a fault ends forgets the rank's collective faults too: they are kept
// for the process (collectives launch on other threads), and a later fit() or a user's
// own collectives must not meet them.
TEST(Fault, AFitThatThrowsLeavesNoCollectiveFaultArmed) {
  hddp::testing::ScopedEnv fault("HDDP_FAULT", "raise@step=2;raise@collective=1000");
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<int> thrown(2, 0);
  std::vector<int> leftOver(2, 0);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      run(rank, size, store, dir, 4);
    } catch (const hddp::Error&) {
      thrown[static_cast<size_t>(rank)] = 1;
    }
    for (int i = 0; i < 1000; ++i) {
      try {
        hddp::fault::beforeCollective(rank, "a collective after fit()");
      } catch (const hddp::DistributedError&) {
        ++leftOver[static_cast<size_t>(rank)];
      }
    }
  });
  EXPECT_EQ(thrown, (std::vector<int>{1, 1})) << "raise@step=2 ends fit() on both ranks";
  EXPECT_EQ(leftOver, (std::vector<int>{0, 0}));
}

// A full disk at the second save (step 4): the save fails on every rank (one writer in a
// shared folder), no half-written file stays, and the next run resumes from step 2.
TEST(Fault, AFullDiskAtASaveFailsEveryRankAndThePreviousCommitResumes) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<std::string> errors(2);
  {
    hddp::testing::ScopedEnv fault("HDDP_FAULT", "nospace@save=2");
    hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
      errors[static_cast<size_t>(rank)] =
          hddp::testing::stateError([&] { run(rank, size, store, dir, 6); });
    });
  }
  for (const auto& e : errors) {
    EXPECT_NE(e.find("saving step 4 failed on rank 0: hddp: No space left on device"),
              std::string::npos)
        << e;
  }
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(dir)) {
    left.push_back(entry.path().filename().string());
  }
  EXPECT_EQ(left, std::vector<std::string>{"state-00000002.hddp"}) << "a half-written file stayed";
  std::vector<hddp::TrainSummary> summaries(2);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] = run(rank, size, store, dir, 6, /*resume=*/true);
  });
  EXPECT_EQ(summaries[0].steps, 4) << "resumed from step 2";
  EXPECT_EQ(summaries[0].totalSteps, 6);
}

// The newest commit cut short (a disk that lost its tail): the one before it resumes.
TEST(Fault, ATruncatedNewestCommitGivesWayToThePreviousOne) {
  const std::string dir = hddp::testing::makeTempDir();
  hddp::testing::runThreads(
      2, [&](int rank, int size, hddp::Store& store) { run(rank, size, store, dir, 6); });
  const std::string newest = hddp::stateFileName(dir, 6);
  fs::resize_file(newest, fs::file_size(newest) / 2);
  std::vector<hddp::TrainSummary> summaries(2);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] = run(rank, size, store, dir, 8, /*resume=*/true);
  });
  EXPECT_EQ(summaries[0].steps, 4) << "resumed from step 4";
  EXPECT_EQ(summaries[0].totalSteps, 8);
}

}  // namespace
