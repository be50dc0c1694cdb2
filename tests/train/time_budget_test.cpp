// The Trainer's time budget (TrainerOptions::timeBudgetSeconds): where it ends the run,
// on every rank alike, what the schedule is told, and how a launcher's restart carries
// the job's budget on. The budget reads an injected clock (TrainerOptions::budgetClock)
// that advances a fixed number of seconds per step, so every step count below is exact
// and no test depends on the machine's speed (DESIGN.md: no test needs a speed).
#include "hddp/train/time_budget.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"

using hddp::testing::runThreads;

namespace {

// A linear classifier on 8x8 synthetic images whose forward advances `clock` by
// `secondsPerSample` per sample: the step's emulated compute on the budget's clock.
// Powers of two keep every sum of seconds exact.
hddp::Trainer::ForwardFn timedForward(torch::nn::Sequential model, double& clock,
                                      double secondsPerSample) {
  return [model, &clock, secondsPerSample](const at::Tensor& x) mutable {
    clock += secondsPerSample * static_cast<double>(x.size(0));
    return model->forward(x);
  };
}

torch::nn::Sequential linearNet() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(64, 4));
}

// Two ranks trained under a time budget: each rank's summary, the last step its schedule
// saw and that step's total, and its evaluations (all, and those after an early stop).
struct BudgetRun {
  std::vector<hddp::TrainSummary> summaries{2};
  std::vector<int64_t> lastTotal = std::vector<int64_t>(2, 0);
  std::vector<int64_t> lastStep = std::vector<int64_t>(2, 0);
  std::vector<int> evaluations = std::vector<int>(2, 0);
  std::vector<int> stopEvaluations = std::vector<int>(2, 0);
  std::vector<double> clockAtEnd = std::vector<double>(2, 0.0);
};

// Global batch 32 over `samples` for `epochs`. With `secondsPerSample` > 0 the budget
// reads an injected clock on which rank r's forward takes (r + 1) x secondsPerSample
// per sample; with 0 it reads the steady clock (the default) and nothing waits.
BudgetRun runUnderBudget(double budgetSeconds, int64_t samples, int64_t epochs,
                         double secondsPerSample) {
  BudgetRun out;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(60);  // a rank left waiting fails, not hangs
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    torch::manual_seed(5);
    auto model = linearNet();
    torch::optim::SGD opt(model->parameters(), 0.01);
    hddp::TrainerOptions o;
    o.globalBatch = 32;
    o.epochs = epochs;
    o.balance = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.timeBudgetSeconds = budgetSeconds;
    double clock = 1000.0;  // any origin
    if (secondsPerSample > 0) {
      o.budgetClock = [&clock] { return clock; };
    }
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(samples, 1, 8, 4);
    hddp::Trainer trainer(*comm, model.ptr(),
                          timedForward(model, clock, (rank + 1) * secondsPerSample),
                          hddp::crossEntropy(), opt, ds, o);
    trainer.setSchedule([&](const hddp::StepInfo& info, torch::optim::Optimizer&) {
      out.lastTotal[rank] = info.totalSteps;
      out.lastStep[rank] = info.step;
    });
    trainer.setEvaluation([&](int64_t) -> std::map<std::string, double> {
      ++out.evaluations[rank];
      out.stopEvaluations[rank] += trainer.stoppedEarly() ? 1 : 0;
      return {{"x", 1.0}};
    });
    out.summaries[rank] = trainer.fit();
    out.clockAtEnd[rank] = clock - 1000.0;
  });
  return out;
}

}  // namespace

// A time budget ends the run at the last step that fits, the same step on every rank
// (the slower rank's clock decides), and the schedule sees the shortened total.
TEST(Trainer, ATimeBudgetEndsTheRunOnTimeOnEveryRankAndTheScheduleKnows) {
  // 50 epochs of 19 steps (950: far more than the budget allows); the budget's
  // re-measurements (every 10 steps) fall inside epochs, where the last step's schedule
  // call is told the final total. On the budget's clock rank 0 takes 1/64 s a step (16
  // samples), rank 1 1/32 s. After 10 steps rank 1 has spent 0.3125 s of the 1.5 s: 38
  // more steps fit, so the run ends after step 48 (rank 0's clock alone would allow 96),
  // and the re-measurements at 20, 30 and 40 agree.
  const BudgetRun run = runUnderBudget(1.5, 608, 50, 1.0 / 1024);
  const auto& summaries = run.summaries;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(summaries[r].steps, 48) << "rank " << r;
    EXPECT_EQ(summaries[r].totalSteps, 48) << "rank " << r;
    EXPECT_EQ(run.lastStep[r] + 1, summaries[r].totalSteps);
    EXPECT_EQ(run.lastTotal[r], summaries[r].totalSteps) << "the schedule saw another total";
    EXPECT_EQ(run.stopEvaluations[r], 1);
    EXPECT_EQ(run.evaluations[r], 3) << "after epochs 1 and 2 (steps 19, 38) and at the stop";
  }
  EXPECT_EQ(run.clockAtEnd[1], 1.5) << "the slower rank used the whole budget, no more";
  EXPECT_EQ(run.clockAtEnd[0], 0.75);
}

// A budget already spent when it is first measured (after 10 steps): the run still ends
// on a step whose schedule call was told it is the last one. Before, the run ended at
// once after step 10, whose schedule call had been told the epochs' 100 steps (in CI
// the same slip showed as 51 against 50 when a re-measurement found no time left).
// On the steady clock (the default): any 10 steps take more than its microsecond.
TEST(Trainer, ABudgetSpentAtItsFirstMeasurementStillTellsTheScheduleTheLastStep) {
  // 640 samples: 20 steps per epoch, the measurement (step 10) inside the epoch; 320: 10,
  // the measurement at the epoch's end, where the run ends with the epoch (not one step
  // into the next, with a second evaluation and a mid-epoch state).
  for (const int64_t samples : {640, 320}) {
    const BudgetRun run = runUnderBudget(1e-6, samples, 5, 0);  // spent before measuring
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(run.lastStep[r] + 1, run.summaries[r].totalSteps) << samples;
      EXPECT_EQ(run.evaluations[r], 1) << samples;
      if (samples == 640) {
        EXPECT_EQ(run.summaries[r].totalSteps, 11) << "one step after the measurement";
        EXPECT_EQ(run.lastTotal[r], run.summaries[r].totalSteps)
            << "the last step's schedule saw another total";
      } else {
        EXPECT_EQ(run.summaries[r].totalSteps, 10) << "the run ends with the epoch";
      }
    }
  }
}

// The time budget is the job's: a restart (TORCHELASTIC_RESTART_COUNT > 0) resumes its
// account from the state, so the planned total (the schedule's totalSteps) does not
// fall back to epochs x steps and the run does not get a whole new budget.
TEST(Trainer, ARestartKeepsTheJobsTimeBudgetAndItsSchedule) {
  // 1/8 s a step on the budget's clock, 8 s of budget: measured after 10 steps (1.25 s
  // spent, 54 more fit), the job has 64 steps. The first run dies in step 33, after the
  // state of step 32 (an epoch's end: 80 samples in steps of 24 are 4 steps) was saved
  // with 4 s spent. The restart's clock starts elsewhere; its job goes on with 4 s spent
  // and ends at step 64 too. A lost budget would plan the epochs' 4000 steps; a whole
  // new budget would plan 32 + 64.
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<int64_t> before, after;
  hddp::TrainSummary summary;
  auto run = [&](std::vector<int64_t>& totals, int64_t crashAt, double clockOrigin) {
    runThreads(1, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      torch::manual_seed(3);
      auto model = linearNet();
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
      hddp::TrainerOptions o;
      o.globalBatch = 24;
      o.epochs = 1000;
      o.balance = false;
      o.progress = hddp::ProgressMode::Off;
      o.loader.workers = 0;
      o.timeBudgetSeconds = 8.0;
      o.saveDir = dir;
      o.saveEvery = 5;
      double clock = clockOrigin;
      o.budgetClock = [&clock] { return clock; };
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
      // 1/8 s a step, whatever its samples (the epoch's last step has 8).
      auto forward = [model, &clock](const torch::Tensor& x) mutable {
        clock += 0.125;
        return model->forward(x);
      };
      hddp::Trainer trainer(*comm, model.ptr(), forward, hddp::crossEntropy(), opt, ds, o);
      trainer.setSchedule([&](const hddp::StepInfo& info, torch::optim::Optimizer&) {
        if (info.step == crashAt) {
          throw std::runtime_error("test: the rank dies");
        }
        totals.push_back(info.totalSteps);
      });
      try {
        summary = trainer.fit();
      } catch (const std::runtime_error&) {
      }
    });
  };
  run(before, 32, 0.0);  // saves at 30 (a commit) and 32 (an epoch's end), dies in step 33
  setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  run(after, -1, 5000.0);
  unsetenv("TORCHELASTIC_RESTART_COUNT");
  ASSERT_EQ(before.size(), 32u);
  for (size_t i = 0; i < before.size(); ++i) {
    // Steps 1-10 were planned before the first measurement: the epochs' 1000 x 4.
    EXPECT_EQ(before[i], i < 10 ? 4000 : 64) << "the first run's step " << i + 1;
  }
  ASSERT_EQ(after.size(), 32u) << "the restart trains steps 33-64";
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i], 64) << "the restart's step " << i + 33;
  }
  EXPECT_EQ(summary.totalSteps, 64);
  EXPECT_EQ(summary.steps, 32);
}

// A budget clock that goes back on one rank fails fit() on every rank with a
// ConfigError that says so, at the agreement where it is read, instead of one rank
// throwing and leaving the other in the agreement's collective.
TEST(Trainer, ABudgetClockThatGoesBackFailsEveryRankTogether) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(60);
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    auto model = linearNet();
    torch::optim::SGD opt(model->parameters(), 0.01);
    hddp::TrainerOptions o;
    o.globalBatch = 32;
    o.epochs = 5;
    o.balance = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.timeBudgetSeconds = 10;
    double clock = 100.0;
    o.budgetClock = [&clock] { return clock; };
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(640, 1, 8, 4);
    // Rank 1's clock runs backwards.
    hddp::Trainer trainer(*comm, model.ptr(),
                          timedForward(model, clock, rank == 1 ? -1.0 / 1024 : 1.0 / 1024),
                          hddp::crossEntropy(), opt, ds, o);
    try {
      trainer.fit();
    } catch (const hddp::ConfigError& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("the time budget's clock went back"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("TrainerOptions::budgetClock"), std::string::npos) << errors[r];
  }
}

// The budget as a loop of one's own uses it (hddp/train/time_budget.h): on two ranks
// whose clocks run at 1 and 2 s per step, the slower decides, every rank gets the same
// end, an evaluation left out does not count, and a resumed account carries the end on.
TEST(TimeBudget, ALoopOfOnesOwnEndsWhereTheSlowestRanksClockSays) {
  std::vector<int64_t> ends(2);
  std::vector<int64_t> steps(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    double clock = 50.0;
    hddp::TimeBudget budget(*comm, /*seconds=*/100, [&clock] { return clock; });
    EXPECT_TRUE(budget.enabled());
    budget.start(0);
    int64_t step = 0;
    int measured = 0;
    while (!budget.reached(step)) {
      clock += rank + 1.0;  // one step
      ++step;
      if (step == 5) {
        const double t0 = budget.now();
        clock += 30;  // an evaluation
        budget.leaveOut(budget.now() - t0);
      }
      measured += budget.afterStep(step, /*lastOfEpoch=*/false) ? 1 : 0;
      ASSERT_LT(step, 1000);
    }
    // Measured at step 10: 20 s of training (+30 left out) on the slower rank, 2 s per
    // step; 50 s left make 25 more steps: the end is step 35, re-measured at 20 and 30
    // (the same slope), where it stays.
    ends[static_cast<size_t>(rank)] = budget.endStep();
    steps[static_cast<size_t>(rank)] = step;
    EXPECT_EQ(measured, 3);
    EXPECT_EQ(budget.capSteps(1000), 35);
    EXPECT_EQ(budget.capSteps(20), 20);
    const hddp::TimeBudget::Account a = budget.account();
    EXPECT_EQ(a.evaluationSeconds, 30.0);
    EXPECT_EQ(a.startStep, 0);
    EXPECT_EQ(a.endStep, 35);
    // A restart carries the account on: the end stays, the seconds go on.
    hddp::TimeBudget again(*comm, 100, [&clock] { return clock; });
    again.resume(a, step);
    EXPECT_EQ(again.endStep(), 35);
    EXPECT_TRUE(again.reached(step));
    EXPECT_EQ(again.account().seconds, a.seconds);
  });
  EXPECT_EQ(ends, (std::vector<int64_t>{35, 35}));
  EXPECT_EQ(steps, (std::vector<int64_t>{35, 35}));
}

TEST(TimeBudget, WithoutSecondsItNeverEndsTheRunAndRunsNoCollective) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(10);  // a collective with no partner fails soon
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    hddp::TimeBudget budget(*comm, 0);
    budget.start(0);
    // Rank 1 calls afterStep more often than rank 0: without a budget no collective runs,
    // so nothing waits.
    for (int64_t step = 1; step <= (rank == 0 ? 10 : 30); ++step) {
      EXPECT_FALSE(budget.afterStep(step, false));
      EXPECT_FALSE(budget.reached(step));
    }
    EXPECT_EQ(budget.capSteps(12), 12);
  });
}
