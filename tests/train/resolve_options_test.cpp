// resolveOptions (hddp/train/trainer.h): the options as the Trainer runs them, a pure
// function of the options given and the rank's facts; and Trainer::options() (as given)
// beside Trainer::resolvedOptions() (as decided).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>

#include "hddp/comm/communicator.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"

namespace {

TEST(ResolveOptions, FillsTheElasticFolderTheLoaderAndTheSeedsAndSaysNothingElse) {
  hddp::TrainerOptions given;
  given.seed = 7;
  given.loader.sampler.minLocalBatch = 0;
  hddp::RankFacts facts;
  facts.device = c10::Device(c10::kCPU);
  facts.elasticDir = "/jobs/7/commits";
  const hddp::ResolvedOptions r = hddp::resolveOptions(given, facts);
  EXPECT_EQ(r.options.saveDir, "/jobs/7/commits");
  EXPECT_EQ(r.options.loader.seed, 7u);
  EXPECT_EQ(r.options.loader.sampler.seed, 7u);
  EXPECT_EQ(r.options.loader.device, c10::Device(c10::kCPU));
  EXPECT_TRUE(r.notes.empty());
  given.saveDir = "mine";  // a folder given wins
  EXPECT_EQ(hddp::resolveOptions(given, facts).options.saveDir, "mine");
}

TEST(ResolveOptions, Bf16FallsBackOnlyWhereItIsNotNativeAndTheFallbackIsOn) {
  hddp::TrainerOptions given;
  given.amp = hddp::AmpMode::Bf16;
  hddp::RankFacts facts;
  facts.bf16Native = false;
  facts.bf16Why = "no avx512_bf16";
  hddp::ResolvedOptions r = hddp::resolveOptions(given, facts);
  EXPECT_EQ(r.options.amp, hddp::AmpMode::Off);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_TRUE(r.notes[0].warn);
  EXPECT_NE(r.notes[0].text.find("no avx512_bf16"), std::string::npos) << r.notes[0].text;
  facts.bf16Fallback = false;  // HDDP_BF16_FALLBACK=0: bf16 anyway
  EXPECT_EQ(hddp::resolveOptions(given, facts).options.amp, hddp::AmpMode::Bf16);
  facts.bf16Fallback = true;
  facts.bf16Native = true;
  r = hddp::resolveOptions(given, facts);
  EXPECT_EQ(r.options.amp, hddp::AmpMode::Bf16);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_FALSE(r.notes[0].warn);
}

TEST(ResolveOptions, ZeroTurnsAutoCompressionOffAndSyncBatchNormKeepsASamplePerRank) {
  hddp::TrainerOptions given;
  given.zero = 1;
  given.ddp.compression = hddp::GradCompression::Auto;
  hddp::RankFacts facts;
  facts.hasSyncBatchNorm = true;
  const hddp::ResolvedOptions r = hddp::resolveOptions(given, facts);
  EXPECT_EQ(r.options.ddp.compression, hddp::GradCompression::None);
  EXPECT_EQ(r.options.planner.minLocalBatch, 1);
  EXPECT_EQ(r.options.loader.sampler.minLocalBatch, 1);
  EXPECT_EQ(r.notes.size(), 2u);
  given.zero = 0;  // without ZeRO, Auto stays for the Trainer to decide
  EXPECT_EQ(hddp::resolveOptions(given, facts).options.ddp.compression,
            hddp::GradCompression::Auto);
}

TEST(ResolveOptions, TheTrainerKeepsTheGivenOptionsBesideTheResolvedOnes) {
  hddp::testing::runThreads(1, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 4));
    torch::optim::SGD opt(model->parameters(), 0.1);
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.seed = 9;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(16, 1, 8, 4);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    EXPECT_EQ(trainer.options().loader.seed, 0u);  // as given
    EXPECT_EQ(trainer.resolvedOptions().loader.seed, 9u);
    EXPECT_EQ(trainer.resolvedOptions().loader.sampler.seed, 9u);
  });
}

}  // namespace
