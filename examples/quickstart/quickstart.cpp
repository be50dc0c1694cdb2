// The README's example: two ranks with unequal shares train like one device.
//   hddp-run --nproc-per-node 2 -- ./build/examples/quickstart/quickstart
#include <hddp/hddp.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  auto ctx = hddp::initFromEnv();  // torchrun, Slurm, Open MPI or hddp-run conventions
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(784, 128), torch::nn::ReLU(),
                              torch::nn::Linear(128, 10));
  hddp::DistributedDataParallel ddp(model, *ctx.communicator);  // same start on every rank
  torch::optim::SGD opt(model->parameters(), 0.1);
  const int64_t globalBatch = 96;
  const int64_t local =
      ctx.worldSize() == 1 ? 96 : (ctx.rank() == 0 ? 64 : 32 / (ctx.worldSize() - 1));
  torch::manual_seed(1 + ctx.rank());
  auto x = torch::randn({local, 784});
  auto y = torch::randint(0, 10, {local});
  double first = 0;
  double last = 0;
  for (int step = 0; step < 50; ++step) {
    ddp.setBatch(local, globalBatch);  // gradients weighted by local / global
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(x), y);
    loss.backward();  // allreduce overlaps backward
    opt.step();       // = a single-device step on all 96 samples
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::printf("rank %d: %lld samples per step, loss %.4f -> %.4f\n", ctx.rank(),
              static_cast<long long>(local), first, last);
  return last < first ? 0 : 1;
}
