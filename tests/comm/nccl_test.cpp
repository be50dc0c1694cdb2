// NCCL communicator on a real GPU (world size 1 on a single-GPU machine), and several
// ranks sharing one GPU through Gloo's staging path. Skipped without CUDA.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
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

}  // namespace
