// Training throughput of ResNet (CIFAR-style 32x32, synthetic data) with hddp's DDP or a
// plain LibTorch loop, one JSON line per rank. Run under a launcher:
//   hddp-run --nproc-per-node 2 -- ddp_resnet_bench --mode ddp --batch 64 --steps 10
//   hddp-run --nproc-per-node 2 -- ddp_resnet_bench --mode plain   (no communication)
// bench/ddp_compare.py runs it next to PyTorch's own DDP and prints the ratios.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>

#include "hddp/hddp.h"
#include "resnet.h"

int main(int argc, char** argv) {
  std::string mode = "ddp";
  std::string arch = "resnet18";
  int64_t batch = 64;
  int steps = 10;
  int warmup = 2;
  int threads = 1;
  CLI::App app{"hddp DDP training-throughput benchmark"};
  app.add_option("--mode", mode, "ddp or plain")
      ->check(CLI::IsMember({"ddp", "plain"}))
      ->capture_default_str();
  app.add_option("--arch", arch, "ResNet variant")->capture_default_str();
  app.add_option("--batch", batch, "Samples per rank per step")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per rank")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);

  torch::manual_seed(0);
  hddp::models::ResNetOptions opts;
  opts.arch = arch;
  hddp::models::ResNet model(opts);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto x = torch::randn({batch, 3, 32, 32});
  auto y = torch::randint(0, 10, {batch}, torch::kLong);

  std::optional<hddp::DistributedContext> ctx;
  std::unique_ptr<hddp::DistributedDataParallel> ddp;
  int rank = 0;
  int world = 1;
  if (mode == "ddp") {
    ctx.emplace(hddp::initFromEnv());
    rank = ctx->rank();
    world = ctx->worldSize();
    ddp = std::make_unique<hddp::DistributedDataParallel>(model, *ctx->communicator);
    ddp->setBatch(batch, batch * world);
  } else if (const char* r = std::getenv("RANK")) {
    rank = std::atoi(r);
  }
  double wait = 0;
  double comm = 0;
  double hidden = 0;
  using Clock = std::chrono::steady_clock;
  Clock::time_point start;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      start = Clock::now();
    }
    optimizer.zero_grad();
    torch::cross_entropy_loss(model->forward(x), y).backward();
    optimizer.step();
    if (ddp && s >= warmup) {
      const auto& st = ddp->lastStepStats();
      wait += st.waitSeconds;
      comm += st.communicationSeconds;
      hidden += st.communicationSeconds > 0 ? 1.0 - st.waitSeconds / st.communicationSeconds : 1.0;
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf(
      "{\"impl\": \"hddp\", \"mode\": \"%s\", \"rank\": %d, \"world\": %d, \"batch\": %lld, "
      "\"steps\": %d, "
      "\"seconds\": %.6f, \"images_per_s\": %.3f, \"compute_images_per_s\": %.3f, "
      "\"wait_s_per_step\": %.6f, \"comm_s_per_step\": %.6f, \"hidden_fraction\": %.4f}\n",
      mode.c_str(), rank, world, static_cast<long long>(batch), steps, seconds,
      batch * steps / seconds, batch * steps / (seconds - wait), wait / steps, comm / steps,
      ddp ? hidden / steps : 0.0);
  std::fflush(stdout);
  return 0;
}
