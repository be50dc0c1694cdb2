// NCCL communicator on a real GPU (world size 1 on a single-GPU machine), several
// ranks sharing one GPU through Gloo's staging path, and a GPU rank with a CPU rank in
// one job. Skipped without CUDA.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/comm/communicator.h"
#include "hddp/comm/rendezvous.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

#define SKIP_WITHOUT_CUDA()                                                                \
  if (!torch::cuda::is_available() || !hddp::ncclAvailable()) {                            \
    GTEST_SKIP() << "needs a CUDA device and the NCCL build (run tools/gpu-check.sh on a " \
                    "GPU machine)";                                                        \
  }

TEST(Nccl, AllreduceBroadcastAllgatherOnOneGpu_CUDA) {
  SKIP_WITHOUT_CUDA();
  auto store = hddp::Store::memory();
  hddp::CommunicatorOptions opts;
  opts.backend = hddp::Backend::Nccl;
  opts.device = c10::Device(c10::kCUDA, 0);
  auto comm = hddp::makeCommunicator(store, 0, 1, opts);
  auto t = torch::arange(1 << 20, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat));
  auto expected = t.clone();
  comm->allreduce(t, {hddp::ReduceOp::Avg}).wait();
  EXPECT_TRUE(t.equal(expected));
  std::vector<torch::Tensor> many = {t.clone(), torch::ones({3}, t.options())};
  comm->allreduceCoalesced(many).wait();
  EXPECT_TRUE(many[1].equal(torch::ones({3}, t.options())));
  comm->broadcast(t, 0).wait();
  std::vector<torch::Tensor> outs = {torch::empty_like(t)};
  comm->allgather(outs, t).wait();
  EXPECT_TRUE(outs[0].equal(t));
  auto bytes = comm->allgatherBytes({1, 2, 3});
  EXPECT_EQ(bytes[0], (std::vector<uint8_t>{1, 2, 3}));
  comm->barrier().wait();
}

TEST(Nccl, GlooStagesCudaTensorsForRanksSharingOneGpu_CUDA) {
  SKIP_WITHOUT_CUDA();
  hddp::testing::runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto t = torch::full({1000}, float(rank + 1), torch::kCUDA);
    comm->allreduce(t).wait();
    EXPECT_TRUE(t.cpu().equal(torch::full({1000}, 3.0f)));
    comm->broadcast(t, 1).wait();
  });
}

// A GPU rank and a CPU rank (hddp-run --devices cuda:0,cpu): the job agrees on Gloo,
// the GPU rank's CUDA tensors go through host memory, and a weighted DDP step over an
// uneven split [3, 5] gives both ranks the gradient of one device on all 8 samples.
TEST(Nccl, GlooServesAGpuRankAndACpuRankInOneJob_CUDA) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  auto reference = torch::nn::Linear(6, 2);
  const auto x = torch::randn({8, 6});
  const auto y = torch::randn({8, 2});
  torch::mse_loss(reference->forward(x), y).backward();
  const auto want = reference->weight.grad().clone();
  std::vector<at::Tensor> grads(2);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    const c10::Device device = rank == 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    hddp::RankDeviceClaim mine;
    mine.host = "h";
    mine.device = device.str();
    mine.ncclAvailable = true;
    const auto claims =
        hddp::exchangeDeviceClaims(store, rank, size, mine, "mixed", std::chrono::seconds(60));
    const auto agreed = hddp::agreeOnBackend(claims);
    ASSERT_EQ(agreed.backend, hddp::Backend::Gloo) << agreed.reason;
    hddp::CommunicatorOptions opts;
    opts.backend = agreed.backend;
    opts.device = device;
    auto comm = hddp::makeCommunicator(store, rank, size, opts);
    auto t = torch::full({1000}, float(rank + 1), torch::TensorOptions().device(device));
    comm->allreduce(t).wait();
    EXPECT_TRUE(t.cpu().equal(torch::full({1000}, 3.0f)));
    auto b = rank == 0 ? torch::arange(16, torch::TensorOptions().device(device)).to(at::kFloat)
                       : torch::zeros({16});
    comm->broadcast(b, 0).wait();
    EXPECT_TRUE(b.cpu().equal(torch::arange(16).to(at::kFloat)));

    auto model = torch::nn::Linear(6, 2);
    {
      torch::NoGradGuard g;
      model->weight.copy_(reference->weight);
      model->bias.copy_(reference->bias);
    }
    model->to(device);
    hddp::DistributedDataParallel ddp(model, *comm);
    const int64_t start = rank == 0 ? 0 : 3;
    const int64_t n = rank == 0 ? 3 : 5;
    ddp.setBatch(n, 8);
    torch::mse_loss(model->forward(x.narrow(0, start, n).to(device)),
                    y.narrow(0, start, n).to(device))
        .backward();
    ddp.finalize();
    grads[rank] = model->weight.grad().cpu();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(grads[r].defined());
    EXPECT_LT((grads[r] - want).abs().max().item<double>(), 1e-5) << "rank " << r;
  }
}

}  // namespace
