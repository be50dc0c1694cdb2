// Plain BatchNorm under unequal shares loses exactness (#52 item 3): on several ranks,
// DistributedDataParallel's construction says so once, naming the layers and the fix,
// unless DdpOptions::allowLocalBatchNorm says per-rank statistics are intended.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "support/log_capture.h"
#include "support/ranks.h"

namespace {

namespace nn = torch::nn;
using hddp::log::Level;
using hddp::testing::LogCapture;
using hddp::testing::runThreads;

// Six BatchNorm layers: two in fields, four in a Sequential.
struct WideImpl : nn::Module {
  WideImpl() {
    bn1 = register_module("bn1", nn::BatchNorm2d(2));
    bn2 = register_module("bn2", nn::BatchNorm2d(2));
    body = register_module("body", nn::Sequential(nn::BatchNorm2d(2), nn::BatchNorm2d(2),
                                                  nn::BatchNorm2d(2), nn::BatchNorm2d(2)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(bn2(bn1(x))); }
  nn::BatchNorm2d bn1{nullptr};
  nn::BatchNorm2d bn2{nullptr};
  nn::Sequential body{nullptr};
};
TORCH_MODULE(Wide);

// Constructs DDP over `makeModel()` on `world` ranks and returns the warnings about
// BatchNorm that were logged.
std::vector<std::string> warningsAtConstruction(
    int world, const std::function<std::shared_ptr<nn::Module>(hddp::Communicator&)>& makeModel,
    hddp::DdpOptions options = {}) {
  LogCapture capture;
  runThreads(world, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto model = makeModel(*comm);
    hddp::DistributedDataParallel ddp(model, *comm, options);
  });
  return capture.lines(Level::Warn, "BatchNorm");
}

TEST(DdpLocalBatchNorm, TwoRanksWarnOnceNamingTheFirstLayersAndTheFix) {
  const auto warnings = warningsAtConstruction(2, [](hddp::Communicator&) { return Wide().ptr(); });
  ASSERT_EQ(warnings.size(), 1u);  // once, on rank 0
  const std::string& w = warnings[0];
  for (const char* part :
       {"6 torch::nn::BatchNorm layer(s)",
        "'bn1', 'bn2', 'body.0', "
        "'body.1', ... (6 in all)",
        "hddp::SyncBatchNorm", "hddp::convertSyncBatchNorm", "DdpOptions::allowLocalBatchNorm"}) {
    EXPECT_NE(w.find(part), std::string::npos) << part << " in " << w;
  }
  EXPECT_EQ(w.find("body.2"), std::string::npos) << w;
  // A module object, not owned by a shared_ptr, as LibTorch programs also hold it.
  LogCapture capture;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    WideImpl model;
    hddp::DistributedDataParallel ddp(model, *comm);
  });
  EXPECT_EQ(capture.lines(Level::Warn, "6 torch::nn::BatchNorm layer(s)").size(), 1u);
}

TEST(DdpLocalBatchNorm, AllowedOneRankEvalModeOrSyncBatchNormIsQuiet) {
  hddp::DdpOptions allowed;
  allowed.allowLocalBatchNorm = true;
  EXPECT_TRUE(warningsAtConstruction(
                  2, [](hddp::Communicator&) { return Wide().ptr(); }, allowed)
                  .empty());
  EXPECT_TRUE(warningsAtConstruction(1, [](hddp::Communicator&) { return Wide().ptr(); }).empty());
  EXPECT_TRUE(warningsAtConstruction(2, [](hddp::Communicator&) {
                Wide model;
                model->eval();  // running statistics: the same on every rank
                return model.ptr();
              }).empty());
  EXPECT_TRUE(warningsAtConstruction(2, [](hddp::Communicator& comm) {
                auto model = nn::Sequential(nn::Linear(2, 2), nn::BatchNorm1d(2));
                hddp::convertSyncBatchNorm(*model, comm);
                return model.ptr();
              }).empty());
  // Without running statistics a BatchNorm normalises by its batch in eval mode too.
  const auto noRunning = warningsAtConstruction(2, [](hddp::Communicator&) {
    auto model =
        nn::Sequential(nn::BatchNorm1d(nn::BatchNorm1dOptions(2).track_running_stats(false)));
    model->eval();
    return model.ptr();
  });
  EXPECT_EQ(noRunning.size(), 1u);
}

// A SyncBatchNorm field never given the group's communicator normalises each rank's share
// too: DDP says so, and is quiet once convertSyncBatchNorm attached it.
TEST(DdpLocalBatchNorm, ASyncBatchNormWithoutTheGroupsCommunicatorIsNamed) {
  const auto detached = warningsAtConstruction(
      2, [](hddp::Communicator&) { return nn::Sequential(hddp::SyncBatchNorm(2)).ptr(); });
  ASSERT_EQ(detached.size(), 1u);
  EXPECT_NE(detached[0].find("1 hddp::SyncBatchNorm layer(s) have no communicator"),
            std::string::npos)
      << detached[0];
  EXPECT_NE(detached[0].find("'0'"), std::string::npos) << detached[0];
  EXPECT_TRUE(warningsAtConstruction(2, [](hddp::Communicator& comm) {
                auto model = nn::Sequential(hddp::SyncBatchNorm(2));
                hddp::convertSyncBatchNorm(*model, comm);
                return model.ptr();
              }).empty());
}

}  // namespace
