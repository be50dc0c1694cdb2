// The example models: shapes, and checkpointed forward/backward identical to plain.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <string>

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

// --stem: torchvision's 7x7/2 conv and max-pool at any image size (a torchvision state
// dict loads into a trainer on 32 px images), the CIFAR 3x3 at any size; the CIFAR-only
// ResNets refuse torchvision's.
TEST(Models, ResNetStemOptionPicksEitherStemAtAnySize) {
  for (const int64_t size : {28, 32, 96}) {
    hddp::models::ResNetOptions o;
    o.imageSize = size;
    o.stem = hddp::models::ResNetStem::Torchvision;
    hddp::models::ResNet tv(o);
    const auto tvConv = tv->named_parameters()["conv1.weight"];
    EXPECT_EQ(tvConv.sizes(), (std::vector<int64_t>{64, 3, 7, 7})) << size;
    // 7x7/2 and the max-pool: a quarter of the side before layer1.
    EXPECT_EQ(tv->forward(torch::randn({2, 3, size, size})).sizes(), (std::vector<int64_t>{2, 10}));
    o.stem = hddp::models::ResNetStem::Cifar;
    hddp::models::ResNet cifar(o);
    EXPECT_EQ(cifar->named_parameters()["conv1.weight"].sizes(),
              (std::vector<int64_t>{64, 3, 3, 3}))
        << size;
    o.stem = hddp::models::ResNetStem::Auto;
    hddp::models::ResNet autoStem(o);
    EXPECT_EQ(autoStem->named_parameters()["conv1.weight"].size(2), size <= 64 ? 3 : 7) << size;
  }
  EXPECT_EQ(hddp::models::parseResNetStem("torchvision"), hddp::models::ResNetStem::Torchvision);
  EXPECT_THROW(hddp::models::parseResNetStem("imagenet"), hddp::Error);
  for (const char* arch : {"resnet20", "resnet9"}) {
    hddp::models::ResNetOptions o;
    o.arch = arch;
    o.stem = hddp::models::ResNetStem::Torchvision;
    EXPECT_THROW(hddp::models::ResNet{o}, hddp::Error) << arch;
  }
}

// ResNet-18/34/50 have torchvision's names and sizes, so state dicts go both ways
// (tests/models/resnet_torchvision_test.py loads them into torchvision itself).
TEST(Models, ImageNetResNetsHaveTorchvisionsNamesAndSizes) {
  struct Expected {
    const char* arch;
    int64_t parameters;  // torchvision.models.<arch>(num_classes=10), torchvision 0.26
    size_t keys;         // len(model.state_dict())
    const char* deepest;
  };
  for (const Expected& e :
       {Expected{"resnet18", 11181642, 122, "layer4.1.bn2.num_batches_tracked"},
        Expected{"resnet34", 21289802, 218, "layer4.2.bn2.num_batches_tracked"},
        Expected{"resnet50", 23528522, 320, "layer4.2.bn3.num_batches_tracked"}}) {
    SCOPED_TRACE(e.arch);
    hddp::models::ResNetOptions o;
    o.arch = e.arch;
    o.imageSize = 224;
    hddp::models::ResNet net(o);
    std::set<std::string> keys;
    int64_t parameters = 0;
    for (const auto& p : net->named_parameters()) {
      keys.insert(p.key());
      parameters += p.value().numel();
    }
    for (const auto& b : net->named_buffers()) {
      keys.insert(b.key());
    }
    EXPECT_EQ(parameters, e.parameters);
    EXPECT_EQ(keys.size(), e.keys);
    for (const char* key : {"conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight",
                            "layer2.0.downsample.0.weight", "layer2.0.downsample.1.running_var",
                            "layer3.1.bn2.bias", "fc.weight", "fc.bias"}) {
      EXPECT_EQ(keys.count(key), 1u) << key;
    }
    EXPECT_EQ(keys.count(e.deepest), 1u) << e.deepest;
    EXPECT_EQ(net->named_parameters()["conv1.weight"].sizes(), (std::vector<int64_t>{64, 3, 7, 7}));
  }
}

TEST(Models, ResNetCheckpointingKeepsGradients) {
  for (const char* arch : {"resnet9", "resnet20", "resnet18"}) {
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
