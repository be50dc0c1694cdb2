// hddp used directly: init, the DDP wrapper, the planner's split, the loop.
//   hddp-run --nproc-per-node 2 -- ./build/examples/quickstart/quickstart
#include <hddp/hddp.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

int main() try {
  auto ctx = hddp::initFromEnv();  // torchrun, Slurm, Open MPI or hddp-run conventions
  torch::manual_seed(0);           // the same initial weights and task on every rank
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 4));
  auto teacher = torch::randn({32, 4});
  hddp::DistributedDataParallel ddp(model, *ctx.communicator);
  torch::optim::SGD opt(model->parameters(), 0.2);
  hddp::PlannerOptions po(/*globalBatch=*/96);
  po.minLocalBatch = 1;
  hddp::BatchPlanner planner(*ctx.communicator, po);  // split by measured speed
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    const hddp::BatchPlan& plan = planner.plan();  // identical on every rank
    const int64_t local = plan.local[ctx.rank()];
    torch::manual_seed(1000 + step);  // this step's global batch; each rank takes its slice
    auto x = torch::randn({plan.global, 32}).narrow(0, plan.offsetOf(ctx.rank()), local);
    auto y = x.matmul(teacher).argmax(1);
    const auto t0 = std::chrono::steady_clock::now();
    ddp.setBatch(local, plan.global);  // gradients weighted by local / global
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(x), y);
    loss.backward();  // bucketed allreduce overlaps backward
    opt.step();       // = one single-device step on all 96 samples
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
    planner.record(local, took.count() - ddp.lastStepStats().waitSeconds);
    planner.endStep();  // every 10 steps: all ranks exchange speeds, derive one new split
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("rank %d: split %s, loss %.3f -> %.3f\n", ctx.rank(),
              planner.plan().describe().c_str(), first, last);
  return last < first ? 0 : 1;
} catch (const hddp::ConfigError& e) {  // a bad device or launch variable: what to change
  std::fprintf(stderr, "quickstart: %s\n", e.what_without_backtrace());
  return 2;
} catch (const c10::Error& e) {  // every hddp and LibTorch error
  std::fprintf(stderr, "quickstart: %s\n", e.what_without_backtrace());
  return 1;
}
