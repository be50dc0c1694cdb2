// convertSyncBatchNorm on LibTorch models as people write them (#52 item 2): the two
// models of pytorch/examples' cpp/dcgan, a generator whose BatchNorm layers are member
// fields registered with register_module, and a discriminator that is a Sequential.
// Whatever the forward can reach is converted; what it reaches through a field is
// refused, naming it and the fix, and nothing is converted then.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "support/ranks.h"

namespace {

namespace nn = torch::nn;
using hddp::testing::runThreads;

// pytorch/examples cpp/dcgan's generator as written there, with its BatchNorm type a
// parameter: nn::BatchNorm2d as in the example, or hddp::SyncBatchNorm, the one change
// in the model's declaration that convertSyncBatchNorm's error asks for.
template <typename Norm>
struct GeneratorImpl : nn::Module {
  explicit GeneratorImpl(int kNoiseSize)
      : conv1(nn::ConvTranspose2dOptions(kNoiseSize, 256, 4).bias(false)),
        batch_norm1(256),
        conv2(nn::ConvTranspose2dOptions(256, 128, 3).stride(2).padding(1).bias(false)),
        batch_norm2(128),
        conv3(nn::ConvTranspose2dOptions(128, 64, 4).stride(2).padding(1).bias(false)),
        batch_norm3(64),
        conv4(nn::ConvTranspose2dOptions(64, 1, 4).stride(2).padding(1).bias(false)) {
    // register_module() is needed if we want to use the parameters() method later on
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv3", conv3);
    register_module("conv4", conv4);
    register_module("batch_norm1", batch_norm1);
    register_module("batch_norm2", batch_norm2);
    register_module("batch_norm3", batch_norm3);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(batch_norm1(conv1(x)));
    x = torch::relu(batch_norm2(conv2(x)));
    x = torch::relu(batch_norm3(conv3(x)));
    x = torch::tanh(conv4(x));
    return x;
  }

  nn::ConvTranspose2d conv1, conv2, conv3, conv4;
  Norm batch_norm1, batch_norm2, batch_norm3;
};

// pytorch/examples cpp/dcgan's discriminator as written there.
nn::Sequential makeDiscriminator() {
  return nn::Sequential(
      // Layer 1
      nn::Conv2d(nn::Conv2dOptions(1, 64, 4).stride(2).padding(1).bias(false)),
      nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      // Layer 2
      nn::Conv2d(nn::Conv2dOptions(64, 128, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(128), nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      // Layer 3
      nn::Conv2d(nn::Conv2dOptions(128, 256, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(256), nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      // Layer 4
      nn::Conv2d(nn::Conv2dOptions(256, 1, 3).stride(1).padding(0).bias(false)), nn::Sigmoid());
}

constexpr int kNoise = 16;

void copyState(nn::Module& to, const nn::Module& from) {
  torch::NoGradGuard g;
  auto params = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    p.value().copy_(params[p.key()]);
  }
  auto buffers = from.named_buffers();
  for (auto& b : to.named_buffers()) {
    b.value().copy_(buffers[b.key()]);
  }
}

double maxDifference(const nn::Module& model, const nn::Module& reference) {
  double d = 0;
  auto params = reference.named_parameters();
  for (const auto& p : model.named_parameters()) {
    d = std::max(d, (p.value() - params[p.key()]).abs().max().item<double>());
  }
  auto buffers = reference.named_buffers();
  for (const auto& b : model.named_buffers()) {
    if (b.value().is_floating_point()) {
      d = std::max(d, (b.value() - buffers[b.key()]).abs().max().item<double>());
    }
  }
  return d;
}

// One iteration of the example's loop on `real` and `noise` (each rank's share): the
// discriminator on real (label 1) and generated (label 0) images, then the generator
// through the discriminator (label 1). Each loss is the mean over the share.
template <typename G>
void ganStep(G& generator, nn::Sequential& discriminator, torch::optim::Optimizer& gOpt,
             torch::optim::Optimizer& dOpt, const torch::Tensor& real, const torch::Tensor& noise) {
  const auto n = real.size(0);
  auto ones = torch::ones({n}, real.options());
  auto zeros = torch::zeros({n}, real.options());
  dOpt.zero_grad();
  auto fake = generator->forward(noise);
  auto dLoss =
      torch::binary_cross_entropy(discriminator->forward(real).reshape(-1), ones) +
      torch::binary_cross_entropy(discriminator->forward(fake.detach()).reshape(-1), zeros);
  dLoss.backward();
  dOpt.step();
  gOpt.zero_grad();
  torch::binary_cross_entropy(discriminator->forward(fake).reshape(-1), ones).backward();
  gOpt.step();
}

TEST(SyncBatchNorm, DcganDiscriminatorAsWrittenIsConvertedInItsSequential) {
  runThreads(1, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(3);
    auto discriminator = makeDiscriminator();
    discriminator->to(torch::kDouble);
    discriminator->eval();
    {
      torch::NoGradGuard g;
      discriminator[3]->as<nn::BatchNorm2dImpl>()->running_mean.fill_(0.25);
    }
    const auto before = discriminator->named_parameters();
    const auto beforeBuffers = discriminator->named_buffers();
    const auto converted = hddp::convertSyncBatchNorm(*discriminator, *comm);
    EXPECT_EQ(converted, (std::vector<std::string>{"3", "6"}));
    for (size_t index : {3, 6}) {
      // The module the Sequential's forward calls is the SyncBatchNorm, and it is the
      // registered one: one object, attached, with the layer's state, dtype and mode.
      auto* sync = discriminator[index]->as<hddp::SyncBatchNormImpl>();
      ASSERT_NE(sync, nullptr) << index;
      EXPECT_EQ(discriminator->named_children()[std::to_string(index)].get(), sync);
      EXPECT_EQ(sync->communicator(), comm.get());
      EXPECT_EQ(sync->weight.scalar_type(), torch::kDouble);
      EXPECT_EQ(sync->num_batches_tracked.scalar_type(),
                beforeBuffers[std::to_string(index) + ".num_batches_tracked"].scalar_type());
      EXPECT_FALSE(sync->is_training());
      EXPECT_TRUE(sync->weight.equal(before[std::to_string(index) + ".weight"]));
    }
    EXPECT_TRUE(discriminator[3]->as<hddp::SyncBatchNormImpl>()->running_mean.equal(
        torch::full({128}, 0.25, torch::kDouble)));
    // The parameters the optimizer should be given are the new layers'.
    EXPECT_EQ(discriminator->parameters().size(), before.size());
  });
}

TEST(SyncBatchNorm, DcganGeneratorAsWrittenIsRefusedNamingItsFieldsAndNothingIsConverted) {
  runThreads(1, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    // The generator's fields and, in the same model, a Sequential that could be
    // converted: a refusal leaves both as they were.
    struct GanImpl : nn::Module {
      GanImpl()
          : generator(std::make_shared<GeneratorImpl<nn::BatchNorm2d>>(kNoise)),
            discriminator(makeDiscriminator()) {
        register_module("generator", generator);
        register_module("discriminator", discriminator);
      }
      std::shared_ptr<GeneratorImpl<nn::BatchNorm2d>> generator;
      nn::Sequential discriminator;
    };
    GanImpl gan;
    try {
      hddp::convertSyncBatchNorm(gan, *comm);
      FAIL() << "a BatchNorm the forward calls through a member field was converted";
    } catch (const hddp::ConfigError& e) {
      const std::string m = e.what_without_backtrace();
      for (const char* name :
           {"'generator.batch_norm1'", "'generator.batch_norm2'", "'generator.batch_norm3'",
            "member field", "hddp::SyncBatchNorm bn{nullptr}", "Nothing was converted"}) {
        EXPECT_NE(m.find(name), std::string::npos) << name << " in " << m;
      }
      EXPECT_EQ(m.find("discriminator"), std::string::npos) << m;
    }
    EXPECT_NE(gan.discriminator[3]->as<nn::BatchNorm2dImpl>(), nullptr);
    EXPECT_NE(gan.named_modules("", false)["discriminator.3"]->as<nn::BatchNorm2dImpl>(), nullptr);
    EXPECT_NE(gan.named_modules("", false)["generator.batch_norm1"]->as<nn::BatchNorm2dImpl>(),
              nullptr);
  });
}

TEST(SyncBatchNorm, LayersHeldInAModuleListOrWithACumulativeAverageAreRefused) {
  runThreads(1, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    nn::ModuleList list(nn::Linear(3, 3), nn::BatchNorm1d(3));
    EXPECT_THROW(hddp::convertSyncBatchNorm(*list, *comm), hddp::ConfigError);
    EXPECT_NE(list[1]->as<nn::BatchNorm1dImpl>(), nullptr);
    nn::Sequential cumulative(nn::BatchNorm1d(nn::BatchNorm1dOptions(3).momentum(std::nullopt)));
    try {
      hddp::convertSyncBatchNorm(*cumulative, *comm);
      FAIL() << "a cumulative moving average was converted to an exponential one";
    } catch (const hddp::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("'0'"), std::string::npos) << e.what();
    }
  });
}

// The generator with its fields declared hddp::SyncBatchNorm and the discriminator as
// written, both converted, two DDP wrappers on one communicator, shares 3 and 5 of 8:
// two iterations of the example's loop equal one device on the whole batch with torch's
// BatchNorm (float64), running statistics included. Per-rank BatchNorm anywhere would be
// ~1e-2 away; a Sequential entry left unconverted would be too.
TEST(SyncBatchNorm, DcganOnTwoRanksWithSharesThreeAndFiveEqualsOneDevice) {
  using PlainGenerator = GeneratorImpl<nn::BatchNorm2d>;
  using SyncGenerator = GeneratorImpl<hddp::SyncBatchNorm>;
  const int64_t B = 8;
  const std::vector<int64_t> split{3, 5};
  torch::manual_seed(7);
  auto refG = std::make_shared<PlainGenerator>(kNoise);
  auto refD = makeDiscriminator();
  refG->to(torch::kDouble);
  refD->to(torch::kDouble);
  auto initialG = std::make_shared<PlainGenerator>(kNoise);
  auto initialD = makeDiscriminator();
  initialG->to(torch::kDouble);
  initialD->to(torch::kDouble);
  copyState(*initialG, *refG);
  copyState(*initialD, *refD);
  std::vector<torch::Tensor> reals;
  std::vector<torch::Tensor> noises;
  for (int s = 0; s < 2; ++s) {
    reals.push_back(torch::rand({B, 1, 28, 28}, torch::kDouble) * 2 - 1);
    noises.push_back(torch::randn({B, kNoise, 1, 1}, torch::kDouble));
  }
  auto sgd = [](const std::vector<torch::Tensor>& params) {
    return torch::optim::SGD(params, torch::optim::SGDOptions(0.05).momentum(0.5));
  };
  {
    auto gOpt = sgd(refG->parameters());
    auto dOpt = sgd(refD->parameters());
    for (int s = 0; s < 2; ++s) {
      ganStep(refG, refD, gOpt, dOpt, reals[s], noises[s]);
    }
  }
  std::vector<double> diffs(2, 1e9);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto generator = std::make_shared<SyncGenerator>(kNoise);
    auto discriminator = makeDiscriminator();
    generator->to(torch::kDouble);
    discriminator->to(torch::kDouble);
    copyState(*generator, *initialG);
    copyState(*discriminator, *initialD);
    EXPECT_TRUE(hddp::convertSyncBatchNorm(*generator, *comm).empty());  // attached only
    EXPECT_EQ(hddp::convertSyncBatchNorm(*discriminator, *comm).size(), 2u);
    EXPECT_NE(discriminator[3]->as<hddp::SyncBatchNormImpl>(), nullptr);
    EXPECT_EQ(generator->batch_norm1->communicator(), comm.get());
    hddp::DistributedDataParallel gDdp(generator, *comm);
    hddp::DistributedDataParallel dDdp(discriminator, *comm);
    auto gOpt = sgd(generator->parameters());
    auto dOpt = sgd(discriminator->parameters());
    const int64_t start = rank == 0 ? 0 : split[0];
    for (int s = 0; s < 2; ++s) {
      gDdp.setBatch(split[rank], B);
      dDdp.setBatch(split[rank], B);
      ganStep(generator, discriminator, gOpt, dOpt, reals[s].narrow(0, start, split[rank]),
              noises[s].narrow(0, start, split[rank]));
    }
    diffs[rank] = std::max(maxDifference(*generator, *refG), maxDifference(*discriminator, *refD));
  });
  EXPECT_LT(diffs[0], 1e-9) << "rank 0";
  EXPECT_LT(diffs[1], 1e-9) << "rank 1";
}

}  // namespace
