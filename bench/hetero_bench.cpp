// Heterogeneous training: ranks of unlike speed (emulated), equal split vs. the planner.
// One JSON line per step from rank 0 ("kind": "step") and one summary line per rank.
//   HDDP_EMULATE_SLOWDOWN=1:3 hddp-run --nproc-per-node 2 -- hetero_bench --mode planner
// Modes: equal (PyTorch DDP's split, hddp's weighting), planner (BatchPlanner), solo (no
// communication: this rank alone with its own emulated speed, for the ideal).
// --change-at S --change-to F: from step S on, rank 1's slowdown becomes F.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>

#include "hddp/hddp.h"
#include "resnet.h"

int main(int argc, char** argv) {
  std::string mode = "planner";
  int64_t globalBatch = 128;
  int steps = 60;
  int warmup = 3;
  int changeAt = -1;
  double changeTo = 1.0;
  int rebalanceEvery = 5;
  bool emulateSleep = false;
  bool trace = false;
  CLI::App app{"heterogeneous data-parallel throughput (emulated unlike ranks)"};
  app.add_option("--mode", mode, "equal, planner or solo")
      ->check(CLI::IsMember({"equal", "planner", "solo"}));
  app.add_option("--global-batch", globalBatch, "Samples per step, all ranks")
      ->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--change-at", changeAt, "Step at which rank 1's slowdown changes (-1: never)");
  app.add_option("--change-to", changeTo, "Rank 1's slowdown from --change-at on");
  app.add_option("--rebalance-every", rebalanceEvery, "Planner: steps between plan updates")
      ->capture_default_str();
  app.add_flag("--emulate-sleep", emulateSleep,
               "Spend the emulated extra time sleeping instead of spinning");
  app.add_flag("--trace", trace,
               "Every rank prints one JSON line per step: emulated, compute, wait and "
               "communication seconds (where a step's time goes)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  const int rank = std::getenv("RANK") ? std::atoi(std::getenv("RANK")) : 0;
  const int worldFromEnv = std::getenv("WORLD_SIZE") ? std::atoi(std::getenv("WORLD_SIZE")) : 1;
  hddp::EmulationOptions emulation = hddp::emulationFromEnv(rank, std::max(1, worldFromEnv));

  torch::manual_seed(0);
  hddp::models::ResNetOptions mo;
  mo.arch = "resnet20";
  mo.inChannels = 1;
  mo.imageSize = 28;
  hddp::models::ResNet model(mo);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto data = torch::randn({globalBatch, 1, 28, 28});
  auto labels = torch::randint(0, 10, {globalBatch}, torch::kLong);

  std::optional<hddp::DistributedContext> ctx;
  std::unique_ptr<hddp::DistributedDataParallel> ddp;
  std::unique_ptr<hddp::BatchPlanner> planner;
  int world = 1;
  if (mode != "solo") {
    ctx.emplace(hddp::initFromEnv());
    world = ctx->worldSize();
    ddp = std::make_unique<hddp::DistributedDataParallel>(model, *ctx->communicator);
    hddp::PlannerOptions po(globalBatch);
    po.rebalanceEvery = rebalanceEvery;
    po.calibrationSteps = warmup;  // warm start: plan from the untimed warm-up steps
    planner = std::make_unique<hddp::BatchPlanner>(*ctx->communicator, po);
  }
  using Clock = std::chrono::steady_clock;
  double perSample = 0;  // this rank's last measured raw compute seconds per sample
  int64_t samplesTotal = 0;
  Clock::time_point start;
  // Emulated time is spent spinning, not sleeping (--emulate-sleep to sleep): a card
  // that is slower keeps computing, and a core that sleeps most of each step comes back
  // slower (caches, frequency), which made the emulated slowdown ~3.8x instead of 3x.
  hddp::Emulator::Sleep wait;
  if (!emulateSleep) {
    wait = [](std::chrono::duration<double> d) {
      const auto end = std::chrono::steady_clock::now() + d;
      while (std::chrono::steady_clock::now() < end) {
      }
    };
  }
  hddp::Emulator emulator(emulation, rank, wait);
  for (int s = 0; s < warmup + steps; ++s) {
    const int step = s - warmup;
    if (s == warmup) {
      start = Clock::now();
    }
    if (changeAt >= 0 && step == changeAt && rank == 1) {
      emulation.slowdown = changeTo;
      emulator = hddp::Emulator(emulation, rank, wait);
    }
    const int64_t local = mode == "solo"
                              ? globalBatch / 2
                              : (mode == "equal" ? hddp::equalSplit(world, globalBatch).local[rank]
                                                 : planner->localBatch());
    const auto t0 = Clock::now();
    // Emulation before the gradients are communicated (a slower card computes longer).
    double extra = emulator.apply(perSample * static_cast<double>(local), 0) -
                   perSample * static_cast<double>(local);
    const auto t1 = Clock::now();
    if (ddp) {
      ddp->setBatch(local, globalBatch);
    }
    opt.zero_grad();
    if (local > 0) {
      torch::cross_entropy_loss(model->forward(data.narrow(0, 0, local)),
                                labels.narrow(0, 0, local))
          .backward();
    } else {
      ddp->finalize();
    }
    opt.step();
    const auto t2 = Clock::now();
    const double wait = ddp ? ddp->lastStepStats().waitSeconds : 0.0;
    const double raw = std::chrono::duration<double>(t2 - t1).count() - wait;
    if (perSample == 0 && local > 0) {
      // First step: no estimate to stretch beforehand, so stretch it now (as the Trainer
      // does), and the planner's calibration sees the emulated speed from the start.
      extra = emulator.apply(raw, 0) - raw;
    }
    if (local > 0) {
      perSample = raw / static_cast<double>(local);
    }
    const double emulatedCompute = raw + extra;
    if (s >= warmup) {
      samplesTotal += local;
    }
    if (planner) {
      planner->record(local, emulatedCompute);
      planner->endStep();
    }
    if (trace) {
      const auto* stats = ddp ? &ddp->lastStepStats() : nullptr;
      std::printf(
          "{\"kind\": \"trace\", \"mode\": \"%s\", \"rank\": %d, \"step\": %d, \"local\": "
          "%lld, \"emulated_s\": %.6f, \"compute_s\": %.6f, \"wait_s\": %.6f, "
          "\"communication_s\": %.6f, \"step_s\": %.6f}\n",
          mode.c_str(), rank, step, static_cast<long long>(local), extra, raw, wait,
          stats ? stats->communicationSeconds : 0.0,
          std::chrono::duration<double>(Clock::now() - t0).count());
    }
    if (rank == 0 && s >= warmup && mode != "solo") {
      std::printf("{\"kind\": \"step\", \"mode\": \"%s\", \"step\": %d, \"local\": [", mode.c_str(),
                  step);
      const auto& plan = mode == "equal" ? hddp::equalSplit(world, globalBatch) : planner->plan();
      for (int r = 0; r < world; ++r) {
        std::printf("%s%lld", r ? ", " : "", static_cast<long long>(plan.local[r]));
      }
      std::printf("], \"step_seconds\": %.6f}\n",
                  std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf(
      "{\"kind\": \"summary\", \"mode\": \"%s\", \"rank\": %d, \"world\": %d, \"steps\": %d, "
      "\"seconds\": %.6f, "
      "\"samples\": %lld, \"global_samples_per_s\": %.4f, \"solo_samples_per_s\": %.4f, "
      "\"slowdown\": %.3f}\n",
      mode.c_str(), rank, world, steps, seconds, static_cast<long long>(samplesTotal),
      static_cast<double>(globalBatch) * steps / seconds, samplesTotal / std::max(seconds, 1e-9),
      emulation.slowdown);
  return 0;
}
