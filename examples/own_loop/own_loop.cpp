// A LibTorch training loop of its own, in the style of pytorch/examples' cpp/mnist (a
// module, a torch::data dataset and make_data_loader, a loop over epochs and batches),
// made distributed with hddp's parts and no Trainer: DDP, balancing (the planner's split
// through PlanSampler), out-of-memory recovery, the time budget and commits.
//
//   hddp-run --nproc-per-node 2 -- ./build/examples/own_loop/own_loop --epochs 2
//   hddp-run --nproc-per-node 2 --max-restarts 3 -- ./build/examples/own_loop --save-dir ckpt
//
// --trainer runs the same job with hddp::Trainer instead (tests/examples/own_loop_test.cpp
// compares the two). Without dropout or BatchNorm, whose draws and statistics follow each
// rank's share, the result does not depend on the split: any split trains as one device
// on the whole batch.
#include <hddp/hddp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int kUsageError = 2;  // a usage error (hddp-run does not restart it)

// cpp/mnist's network, for images of any size divisible by 4 (without its dropout).
struct Net : torch::nn::Module {
  Net(int channels, int size, int64_t classes)
      : conv1(torch::nn::Conv2dOptions(channels, 10, 3).padding(1)),
        conv2(torch::nn::Conv2dOptions(10, 20, 3).padding(1)),
        fc1(20 * (size / 4) * (size / 4), 50),
        fc2(50, classes) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2->forward(x), 2));
    x = torch::relu(fc1->forward(x.flatten(1)));
    return torch::log_softmax(fc2->forward(x), /*dim=*/1);
  }
  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

// A torch::data dataset over hddp's synthetic images (the Trainer reads the same ones).
class Images : public torch::data::datasets::Dataset<Images> {
 public:
  explicit Images(std::shared_ptr<const hddp::Dataset> data) : data_(std::move(data)) {}
  torch::data::Example<> get(size_t index) override {
    hddp::SampleRng unused(0);
    hddp::Example e = data_->get(static_cast<int64_t>(index), unused);
    return {e.input, e.target};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(data_->size()); }

 private:
  std::shared_ptr<const hddp::Dataset> data_;
};

struct Flags {
  int64_t globalBatch = 32;
  int64_t epochs = 2;
  int64_t maxSteps = 0;  // 0: the epochs decide
  int64_t samples = 512;
  double lr = 0.05;
  uint64_t seed = 1;
  double timeBudget = 0;
  std::string saveDir;
  int64_t saveEvery = 4;
  std::vector<int64_t> maxLocalBatch;
  std::string saveParams;
  bool trainer = false;
};

// Everything a commit holds: the model, the optimizer, the sampler's position, the
// planner's shared state (its split and learned memory caps) and where the loop stands.
void writeCommit(torch::serialize::OutputArchive& a, Net& model, torch::optim::Optimizer& opt,
                 const hddp::PlanSampler& sampler, const hddp::BatchPlanner& planner,
                 const hddp::TimeBudget& budget, int64_t epoch) {
  for (const auto& p : model.named_parameters()) {
    a.write("model." + p.key(), p.value().detach().cpu());
  }
  torch::serialize::OutputArchive optimizer;
  opt.save(optimizer);
  a.write("optimizer", optimizer);
  sampler.save(a);
  torch::serialize::OutputArchive shared;
  torch::serialize::OutputArchive own;
  planner.save(shared, own);
  a.write("planner", shared);
  a.write("epoch", torch::tensor(std::vector<int64_t>{epoch}));
  const hddp::TimeBudget::Account b = budget.account();  // the job's, across restarts
  a.write("budget", torch::tensor(std::vector<double>{b.seconds, b.evaluationSeconds,
                                                      static_cast<double>(b.startStep),
                                                      static_cast<double>(b.endStep)},
                                  torch::kDouble));
}

int64_t readCommit(torch::serialize::InputArchive& a, Net& model, torch::optim::Optimizer& opt,
                   hddp::PlanSampler& sampler, hddp::BatchPlanner& planner,
                   hddp::TimeBudget::Account& budget, int worldSize) {
  torch::NoGradGuard noGrad;
  for (auto& p : model.named_parameters()) {
    at::Tensor saved;
    a.read("model." + p.key(), saved);
    p.value().copy_(saved);  // a copy: DDP's hooks stay on the parameters
  }
  torch::serialize::InputArchive optimizer;
  a.read("optimizer", optimizer);
  opt.load(optimizer);
  sampler.load(a);
  torch::serialize::InputArchive shared;
  a.read("planner", shared);
  std::vector<int> same(static_cast<size_t>(worldSize));
  for (int r = 0; r < worldSize; ++r) {
    same[static_cast<size_t>(r)] = r;
  }
  planner.loadRemapped(shared, nullptr, same);
  at::Tensor b;
  a.read("budget", b);
  b = b.to(torch::kDouble).contiguous();
  TORCH_CHECK(b.numel() == 4, "the commit's budget entry holds ", b.numel(), " numbers, not 4");
  const double* v = b.data_ptr<double>();
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(std::isfinite(v[i]) && v[i] >= 0 && v[i] < 9.0e18,
                "the commit's budget entry holds ", v[i]);
  }
  budget = {v[0], v[1], static_cast<int64_t>(v[2]), static_cast<int64_t>(v[3])};
  at::Tensor epoch;
  a.read("epoch", epoch);
  TORCH_CHECK(epoch.numel() == 1 && epoch.item<int64_t>() >= 0, "the commit's epoch is not one");
  return epoch.item<int64_t>();
}

void saveParameters(Net& model, const std::string& path) {
  std::vector<at::Tensor> params;
  for (const auto& p : model.parameters()) {
    params.push_back(p.detach().cpu().clone());
  }
  torch::save(params, path);
}

// The job with hddp::Trainer: what the loop below does by hand.
void trainWithTrainer(hddp::DistributedContext& ctx, const Flags& f, std::shared_ptr<Net> model,
                      std::shared_ptr<const hddp::Dataset> data) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(f.lr).momentum(0.5));
  hddp::TrainerOptions o;
  o.globalBatch = f.globalBatch;
  o.epochs = f.epochs;
  o.maxSteps = f.maxSteps;
  o.seed = f.seed;
  o.timeBudgetSeconds = f.timeBudget;
  o.saveDir = f.saveDir;
  o.saveEvery = f.saveDir.empty() ? 0 : f.saveEvery;
  o.maxLocalBatch = f.maxLocalBatch;
  o.loader.workers = 0;
  o.launch = ctx.info;
  hddp::Trainer trainer(
      *ctx.communicator, model, hddp::forwardOf(model),
      [](const at::Tensor& out, const at::Tensor& y) { return torch::nll_loss(out, y); }, opt, data,
      o);
  const hddp::TrainSummary s = trainer.fit();
  if (ctx.rank() == 0) {
    std::printf("trainer: %lld steps, split %s, loss %.4f\n", static_cast<long long>(s.totalSteps),
                trainer.plan().describe().c_str(), s.lastTrainLoss);
  }
}

void trainOwnLoop(hddp::DistributedContext& ctx, const Flags& f, std::shared_ptr<Net> model,
                  std::shared_ptr<const hddp::Dataset> data) {
  hddp::Communicator& comm = *ctx.communicator;
  const int rank = ctx.rank();
  const c10::Device device = ctx.device;
  hddp::DistributedDataParallel ddp(model, comm);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(f.lr).momentum(0.5));
  // Balancing: the planner splits each step by measured speed, within memory caps.
  hddp::PlannerOptions po(f.globalBatch);
  po.minLocalBatch = 1;  // torch's loader cannot hand out an empty batch
  hddp::BatchPlanner planner(comm, po);
  for (size_t r = 0; r < f.maxLocalBatch.size() && r < static_cast<size_t>(comm.size()); ++r) {
    if (f.maxLocalBatch[r] > 0) {
      planner.setMemoryCap(static_cast<int>(r), f.maxLocalBatch[r]);
    }
  }
  hddp::SamplerOptions so;
  so.seed = f.seed;
  hddp::PlanSampler sampler(data->size(), planner, rank, so);
  // workers(0): a step given up after running out of memory is served again, which a
  // loader that asked ahead could not do (PlanSampler::repeatLastStep).
  auto loader = torch::data::make_data_loader(
      Images(data).map(torch::data::transforms::Stack<>()), sampler,
      torch::data::DataLoaderOptions().batch_size(static_cast<size_t>(f.globalBatch)).workers(0));
  // Out-of-memory recovery, with what the forward changes put back on a repeat; a memory
  // cap to run into comes from HDDP_EMULATE_MEMORY_CAP (announced in the log).
  const hddp::Emulator emulator(hddp::emulationFromEnv(rank, comm.size()), rank);
  hddp::StepRollback rollback(*model, device);
  hddp::OutOfMemoryRecovery recovery(comm, ddp, &planner, &rollback, device, po.minLocalBatch);
  hddp::TimeBudget budget(comm, f.timeBudget);
  std::unique_ptr<hddp::Commits> commits;
  int64_t step = 0;
  int64_t epoch = 0;
  std::optional<hddp::TimeBudget::Account> account;
  if (!f.saveDir.empty()) {
    commits = std::make_unique<hddp::Commits>(comm, f.saveDir);
    // A launcher's restart goes on from the newest commit (none: a fresh start).
    step = commits
               ->resume([&](torch::serialize::InputArchive& a) {
                 account.emplace();
                 epoch = readCommit(a, *model, opt, sampler, planner, *account, comm.size());
               })
               .value_or(0);
  }
  hddp::fault::arm(rank, ctx.info.jobRestarts, ctx.info.slot);  // HDDP_FAULT, for tests
  if (account) {
    budget.resume(*account, step);  // the job's budget goes on where the commit left it
  } else {
    budget.start(step);
  }
  const auto commit = [&] {
    if (commits) {
      commits->save(step, [&](torch::serialize::OutputArchive& a) {
        writeCommit(a, *model, opt, sampler, planner, budget, sampler.epoch());
      });
    }
  };
  bool stop = false;
  double lastLoss = 0;
  for (; epoch < f.epochs && !stop; ++epoch) {
    sampler.setEpoch(epoch);
    model->train();
    for (auto& batch : *loader) {
      if ((f.maxSteps > 0 && step >= f.maxSteps) || budget.reached(step)) {
        stop = true;  // this batch is not taken: a commit's position stays before it
        break;
      }
      const hddp::StepShare share = sampler.stepOfBatch();
      hddp::fault::at(hddp::fault::Point::Step, step + 1);
      const auto t0 = std::chrono::steady_clock::now();
      ddp.setBatch(share.localBatch, share.globalBatch);  // gradients weighted by local/global
      opt.zero_grad();
      rollback.capture();
      at::Tensor loss;
      recovery.run([&] {
        emulator.checkMemory(share.localBatch);
        loss = torch::nll_loss(model->forward(batch.data.to(device)), batch.target.to(device));
        loss.backward();  // DDP's bucketed allreduce overlaps it
      });
      comm.synchronize();
      if (const auto outcome = recovery.afterBackward(share.localBatch, step + 1)) {
        sampler.repeatLastStep();  // the same samples again, under the planner's new split
        continue;
      }
      opt.step();  // = one single-device step on the whole global batch
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
      planner.record(share.localBatch, took.count() - ddp.lastStepStats().waitSeconds);
      planner.endStep();  // every 10 steps: the ranks agree on a new split
      ++step;
      lastLoss = hddp::globalMeanLoss(comm, loss, share.localBatch);
      budget.afterStep(step, /*lastOfEpoch=*/sampler.state().position >= data->size());
      if (commits && step % f.saveEvery == 0) {
        commit();
      }
    }
  }
  if (commits && step % f.saveEvery != 0) {
    commit();
  }
  if (rank == 0) {
    std::printf("own loop: %lld steps, split %s, loss %.4f, %lld steps repeated\n",
                static_cast<long long>(step), planner.plan().describe().c_str(), lastLoss,
                static_cast<long long>(recovery.repeatedSteps()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"A LibTorch loop of its own made distributed with hddp's parts"};
  app.add_option("--global-batch", f.globalBatch, "samples per step over all ranks")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--epochs", f.epochs)->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--max-steps", f.maxSteps, "stop after this many steps (0: the epochs decide)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--samples", f.samples, "synthetic images of 1x8x8 in 4 classes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--lr", f.lr)->check(CLI::PositiveNumber);
  app.add_option("--seed", f.seed);
  app.add_option("--time-budget", f.timeBudget, "seconds the run may train (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--save-dir", f.saveDir, "commits go here; a restart resumes the newest");
  app.add_option("--save-every", f.saveEvery, "steps between commits")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--max-local-batch", f.maxLocalBatch, "memory caps by rank, e.g. 0 12 (0: none)")
      ->delimiter(',');
  app.add_option("--save-params", f.saveParams,
                 "rank 0 writes the final parameters here (torch::save)");
  app.add_flag("--trainer", f.trainer, "train with hddp::Trainer instead of the loop");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kUsageError;
  }
  try {
    auto ctx = hddp::initFromEnv();
    torch::manual_seed(static_cast<uint64_t>(f.seed));  // the same weights on every rank
    auto data = std::make_shared<hddp::SyntheticClassificationDataset>(f.samples, 1, 8, 4, f.seed);
    auto model = std::make_shared<Net>(1, 8, 4);
    model->to(ctx.device);
    if (f.trainer) {
      trainWithTrainer(ctx, f, model, data);
    } else {
      trainOwnLoop(ctx, f, model, data);
    }
    if (ctx.rank() == 0 && !f.saveParams.empty()) {
      saveParameters(*model, f.saveParams);
    }
    return 0;
  } catch (const hddp::ConfigError& e) {  // what to change
    std::fprintf(stderr, "own_loop: %s\n", e.what_without_backtrace());
    return kUsageError;
  } catch (const c10::Error& e) {  // every hddp and LibTorch error
    std::fprintf(stderr, "own_loop: %s\n", e.what_without_backtrace());
    return 1;
  }
}
