// The example models: shapes, and checkpointed forward/backward identical to plain.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/core/error.h"
#include "resnet.h"
#include "unet.h"

namespace {

template <typename Model, typename Options>
void expectCheckpointingKeepsGradients(Options o, const torch::Tensor& x, const torch::Tensor& y) {
  torch::manual_seed(3);
  o.checkpointActivations = false;
  Model plain(o);
  o.checkpointActivations = true;
  Model ckpt(o);
  {
    torch::NoGradGuard g;
    auto src = plain->named_parameters();
    for (auto& p : ckpt->named_parameters()) {
      p.value().copy_(src[p.key()]);
    }
  }
  torch::cross_entropy_loss(plain->forward(x), y).backward();
  torch::cross_entropy_loss(ckpt->forward(x), y).backward();
  auto src = plain->named_parameters();
  for (auto& p : ckpt->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::allclose(p.value().grad(), src[p.key()].grad(), 1e-5, 1e-6)) << p.key();
  }
}

TEST(Models, ResNetShapesAndStems) {
  for (const char* arch : {"resnet9", "resnet20", "resnet18", "resnet50"}) {
    hddp::models::ResNetOptions o;
    o.arch = arch;
    o.inChannels = 1;
    o.imageSize = 28;
    hddp::models::ResNet net(o);
    EXPECT_EQ(net->forward(torch::randn({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}))
        << arch;
  }
  hddp::models::ResNetOptions big;
  big.imageSize = 96;  // ImageNet stem
  hddp::models::ResNet net(big);
  EXPECT_EQ(net->forward(torch::randn({1, 3, 96, 96})).sizes(), (std::vector<int64_t>{1, 10}));
  hddp::models::ResNetOptions bad;
  bad.arch = "resnet19";
  EXPECT_THROW(hddp::models::ResNet{bad}, hddp::Error);
}

TEST(Models, ResNetCheckpointingKeepsGradients) {
  for (const char* arch : {"resnet9", "resnet20"}) {
    SCOPED_TRACE(arch);
    hddp::models::ResNetOptions o;
    o.arch = arch;
    auto x = torch::randn({4, 3, 16, 16});
    auto y = torch::randint(0, 10, {4}, torch::kLong);
    expectCheckpointingKeepsGradients<hddp::models::ResNet>(o, x, y);
  }
}

TEST(Models, ResNet9IsTheQuarterWidthDawnBenchNet) {
  hddp::models::ResNetOptions o;
  o.arch = "resnet9";
  o.inChannels = 1;
  hddp::models::ResNet net(o);
  int64_t params = 0;
  int64_t convs = 0;
  for (const auto& p : net->named_parameters()) {
    params += p.value().numel();
    convs += p.value().dim() == 4 ? 1 : 0;
  }
  // The same network written in PyTorch (conv-BN-ReLU 1->16; 16->32, pool, residual of
  // two 32->32; 32->64, pool; 64->128, pool, residual of two 128->128; max-pool; fc)
  // has 412,666 parameters.
  EXPECT_EQ(params, 412666);
  EXPECT_EQ(convs, 8);
}

TEST(Models, UNetShapesAndCheckpointingKeepsGradients) {
  hddp::models::UNetOptions o;
  o.depth = 2;
  o.baseWidth = 4;
  o.numClasses = 3;
  hddp::models::UNet net(o);
  EXPECT_EQ(net->forward(torch::randn({2, 1, 16, 16})).sizes(),
            (std::vector<int64_t>{2, 3, 16, 16}));
  EXPECT_THROW(net->forward(torch::randn({2, 1, 15, 16})), hddp::Error);
  auto x = torch::randn({2, 1, 16, 16});
  auto y = torch::randint(0, 3, {2, 16, 16}, torch::kLong);
  expectCheckpointingKeepsGradients<hddp::models::UNet>(o, x, y);
}

}  // namespace
