// Allreduce bus bandwidth of hddp's communicator, one JSON line per message size.
// Run under a launcher (hddp-run, torchrun --no-python, srun, mpirun); rank 0 prints.
//   hddp-run --nproc-per-node 2 -- allreduce_bench --min-bytes 4096 --max-bytes 67108864
// Bus bandwidth = bytes * 2 (n - 1) / n / time, the nccl-tests convention, so the
// figure is comparable across world sizes. bench/allreduce_compare.py runs this next to
// PyTorch's torch.distributed Gloo and prints the ratio table.
#include <ATen/ATen.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "hddp/hddp.h"

int main(int argc, char** argv) {
  int64_t minBytes = 4096;
  int64_t maxBytes = 64 << 20;
  double secondsPerSize = 0.5;
  int warmup = 3;
  CLI::App app{"hddp allreduce bus-bandwidth benchmark"};
  app.add_option("--min-bytes", minBytes, "Smallest message")->capture_default_str();
  app.add_option("--max-bytes", maxBytes, "Largest message (sizes grow x4)")->capture_default_str();
  app.add_option("--seconds", secondsPerSize, "Time spent per size")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed iterations per size")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto ctx = hddp::initFromEnv();
  auto& comm = *ctx.communicator;
  const int n = ctx.worldSize();
  for (int64_t bytes = minBytes; bytes <= maxBytes; bytes *= 4) {
    at::Tensor t = at::ones({bytes / 4}, at::kFloat);
    for (int i = 0; i < warmup; ++i) {
      comm.allreduce(t).wait();
    }
    // All ranks agree on the iteration count: rank 0 decides from a timed probe.
    comm.barrier().wait();
    auto t0 = std::chrono::steady_clock::now();
    comm.allreduce(t).wait();
    double probe = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    at::Tensor iters = at::full(
        {1}, static_cast<int64_t>(std::clamp(secondsPerSize / std::max(probe, 1e-6), 5.0, 5000.0)),
        at::kLong);
    comm.broadcast(iters, 0).wait();
    const int64_t count = iters.item<int64_t>();
    comm.barrier().wait();
    t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < count; ++i) {
      comm.allreduce(t).wait();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / count;
    const double busGBps =
        n > 1 ? bytes * 2.0 * (n - 1) / n / seconds / 1e9 : bytes / seconds / 1e9;
    if (ctx.rank() == 0) {
      std::printf(
          "{\"impl\": \"hddp\", \"world\": %d, \"bytes\": %lld, \"iters\": %lld, "
          "\"seconds\": %.9f, \"bus_GBps\": %.6f}\n",
          n, static_cast<long long>(bytes), static_cast<long long>(count), seconds, busGBps);
      std::fflush(stdout);
    }
  }
  return 0;
}
