// One rank of the ZeRO memory benchmark (bench/zero_memory.py drives it): an MLP of a
// given width trained with Adam by hddp's Trainer on the emulated accelerator, whose
// allocator counts every allocation against this rank's total (a small and a large
// card: --totals 8:24 in --unit-mib units) and throws c10::OutOfMemoryError beyond it.
// The rank prints one JSON line: whether it trained, its peak allocated bytes, its
// optimizer state bytes and the job's samples/s. A rank out of memory exits 3 (and
// hddp-run ends the job).
//   hddp-run --nproc-per-node 2 -- zero_memory_bench --zero 2 --shard-by memory --width 512
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <sstream>

#include "hddp/emu/emu.h"
#include "hddp/hddp.h"

namespace {

struct WideMlpImpl : torch::nn::Module {
  WideMlpImpl(int64_t in, int64_t width, int layers, int64_t classes) {
    input = register_module("input", torch::nn::Linear(in, width));
    for (int i = 0; i < layers; ++i) {
      hidden->push_back(torch::nn::Linear(width, width));
    }
    register_module("hidden", hidden);
    output = register_module("output", torch::nn::Linear(width, classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(input(x.flatten(1)));
    for (auto& layer : *hidden) {
      x = torch::relu(layer->as<torch::nn::Linear>()->forward(x));
    }
    return output(x);
  }
  torch::nn::Linear input{nullptr};
  torch::nn::ModuleList hidden;
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(WideMlp);

std::vector<double> parseTotals(const std::string& text) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ':')) {
    out.push_back(std::stod(item));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int zero = 0;
  std::string shardBy = "memory";
  int64_t width = 256;
  int layers = 16;
  int64_t globalBatch = 16;
  int steps = 4;
  std::string totals = "8:24";
  double unitMib = 8;
  double bucketMib = 0.25;
  bool balance = false;
  std::string metrics;
  CLI::App app{"ZeRO memory benchmark: one rank (bench/zero_memory.py runs it)"};
  app.add_option("--zero", zero, "0 plain DDP, 1 or 2")->check(CLI::Range(0, 2));
  app.add_option("--shard-by", shardBy, "memory, equal or R0:R1");
  app.add_option("--width", width, "Hidden width")->capture_default_str();
  app.add_option("--layers", layers, "Hidden layers")->capture_default_str();
  app.add_option("--global-batch", globalBatch, "Samples per step")->capture_default_str();
  app.add_option("--steps", steps, "Steps")->capture_default_str();
  app.add_option("--totals", totals, "Device totals per rank, in units")->capture_default_str();
  app.add_option("--unit-mib", unitMib, "One unit, MiB")->capture_default_str();
  app.add_option("--bucket-mib", bucketMib, "DDP bucket cap and ZeRO gather chunk, MiB")
      ->capture_default_str();
  app.add_flag("--balance", balance,
               "The planner splits the batch (and derives memory caps); default: equal shares");
  app.add_option("--metrics", metrics, "The Trainer's JSON-lines metrics");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  hddp::emu::install();
  hddp::InitOptions init;
  const int localRank = std::getenv("LOCAL_RANK") ? std::atoi(std::getenv("LOCAL_RANK")) : 0;
  init.device = c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(localRank));
  auto ctx = hddp::initFromEnv(init);
  const int rank = ctx.rank();
  const auto unitTotals = parseTotals(totals);
  HDDP_CHECK(static_cast<int>(unitTotals.size()) == ctx.worldSize(), "--totals gives ",
             unitTotals.size(), " totals for ", ctx.worldSize(), " ranks");
  const int64_t total = static_cast<int64_t>(unitTotals[rank] * unitMib * 1024 * 1024);
  hddp::emu::setOwnDevice(localRank);
  hddp::emu::setMemoryTotal(localRank, total);
  std::printf("{\"kind\":\"start\",\"rank\":%d,\"total_bytes\":%lld}\n", rank,
              static_cast<long long>(total));
  std::fflush(stdout);

  torch::manual_seed(0);
  WideMlp model(64, width, layers, 10);
  int64_t params = 0;
  for (const auto& p : model->parameters()) {
    params += p.numel();
  }
  model->to(ctx.device);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-4));
  auto train =
      std::make_shared<hddp::SyntheticClassificationDataset>(globalBatch * steps, 1, 8, 10);
  hddp::TrainerOptions o;
  o.globalBatch = globalBatch;
  o.maxSteps = steps;
  o.epochs = 1;
  o.balance = balance;  // default: equal batch shares, memory is the question here
  o.metricsPath = metrics;
  o.recoverFromOutOfMemory = false;  // out of memory ends the rank (exit 3)
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 0;
  o.ddp.firstBucketBytes = static_cast<int64_t>(bucketMib * 1024 * 1024);
  o.ddp.bucketCapBytes = static_cast<int64_t>(bucketMib * 1024 * 1024);
  o.ddp.bufferSync = hddp::BufferSync::None;
  o.zero = zero;
  o.shardBy = hddp::parseShardBy(shardBy);
  try {
    hddp::Trainer trainer(
        *ctx.communicator, model.ptr(), [&](const at::Tensor& x) { return model->forward(x); },
        hddp::crossEntropy(), adam, train, o);
    // The peak of the construction (the Trainer resets the allocator's peak at each
    // step), then of the steps.
    auto* allocator = c10::getDeviceAllocator(ctx.device.type());
    const int64_t constructionPeak =
        allocator->getDeviceStats(ctx.device.index()).allocated_bytes[0].peak;
    const auto summary = trainer.fit();
    const int64_t peak =
        std::max<int64_t>(constructionPeak, static_cast<int64_t>(summary.peakMemoryBytes));
    std::printf(
        "{\"kind\":\"result\",\"rank\":%d,\"ok\":true,\"width\":%lld,\"params\":%lld,"
        "\"peak_bytes\":%lld,\"total_bytes\":%lld,\"state_bytes\":%lld,\"samples_per_s\":%.3f}\n",
        rank, static_cast<long long>(width), static_cast<long long>(params),
        static_cast<long long>(peak), static_cast<long long>(total),
        static_cast<long long>(hddp::optimizerStateBytes(adam)), summary.samplesPerSecond);
    std::fflush(stdout);
  } catch (const c10::OutOfMemoryError& e) {
    std::printf("{\"kind\":\"result\",\"rank\":%d,\"ok\":false,\"width\":%lld,\"params\":%lld}\n",
                rank, static_cast<long long>(width), static_cast<long long>(params));
    std::fflush(stdout);
    std::fprintf(stderr, "rank %d out of memory: %s\n", rank, e.what_without_backtrace());
    std::_Exit(3);
  }
  return 0;
}
