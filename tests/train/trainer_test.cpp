// The Trainer training: its loss with label smoothing, that it learns and writes metrics
// and a timeline, SyncBatchNorm's collectives on every rank in every step, the options
// it refuses, and gradient clipping with a tied weight.
#include "hddp/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "support/ranks.h"
#include "support/trainer_runs.h"

using hddp::testing::runThreads;
using hddp::testing::trainRun;

namespace {

// Net with SyncBatchNorm: every rank must run its forward collectives in every step.
struct SyncNetImpl : torch::nn::Module {
  SyncNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)));
    bn = register_module("bn", hddp::SyncBatchNorm(6));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(torch::relu(bn->forward(conv->forward(x))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  hddp::SyncBatchNorm bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SyncNet);

}  // namespace

TEST(Trainer, CrossEntropyWithLabelSmoothingIsItsFormula) {
  torch::manual_seed(5);
  const auto logits = torch::randn({6, 5});
  const auto target = torch::randint(0, 5, {6}, torch::kLong);
  const double eps = 0.1;
  const auto logp = torch::log_softmax(logits, 1);
  // -(1 - eps) log p(target) - eps/K sum_k log p(k), averaged over the samples.
  const auto expected =
      (-(1 - eps) * logp.gather(1, target.unsqueeze(1)).squeeze(1) - eps / 5 * logp.sum(1)).mean();
  EXPECT_NEAR(hddp::crossEntropy(eps)(logits, target).item<double>(), expected.item<double>(),
              1e-6);
  EXPECT_NEAR(hddp::crossEntropy()(logits, target).item<double>(),
              -logp.gather(1, target.unsqueeze(1)).mean().item<double>(), 1e-6);
  EXPECT_THROW(hddp::crossEntropy(1.0), hddp::ConfigError);
}

TEST(Trainer, LearnsAndWritesMetricsAndTimeline) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<hddp::TrainSummary> summaries(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[rank] = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 6;
      o.metricsPath = dir + "/metrics.jsonl";
      o.timelinePath = dir + "/timeline.json";
    });
  });
  EXPECT_EQ(summaries[0].totalSteps, 24);
  std::vector<double> epochLoss;
  for (const char* name : {"metrics.jsonl", "metrics.rank1.jsonl"}) {
    std::ifstream in(dir + "/" + name);
    ASSERT_TRUE(in.good()) << name;
    std::string line;
    int steps = 0;
    int summariesSeen = 0;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      const std::string kind = j.at("kind");
      if (kind == "step") {
        ++steps;
        for (const char* key : {"samples_per_s", "local_batch", "share", "data_wait_s", "compute_s",
                                "comm_wait_s", "loss", "loss_scale"}) {
          EXPECT_TRUE(j.contains(key)) << key;
        }
      } else if (kind == "epoch" && std::string(name) == "metrics.jsonl") {
        epochLoss.push_back(j.at("train_loss"));
      } else if (kind == "summary") {
        ++summariesSeen;
      }
    }
    EXPECT_EQ(steps, 24) << name;
    EXPECT_EQ(summariesSeen, 1) << name;
  }
  ASSERT_EQ(epochLoss.size(), 6u);
  EXPECT_LT(epochLoss.back(), 0.7 * epochLoss.front());
  std::ifstream in(dir + "/timeline.json");
  auto trace = nlohmann::json::parse(in);
  std::set<int> pids;
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") {
      pids.insert(e.at("pid").get<int>());
      names.insert(e.at("name").get<std::string>());
    }
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  for (const char* phase : {"data wait", "forward", "backward", "optimizer", "allreduce"}) {
    EXPECT_TRUE(names.count(phase)) << phase;
  }
}

// SyncBatchNorm runs collectives in forward: a rank with no samples would skip them and
// the others would wait forever. With a 10x slower rank (whose share would round to 0)
// and a last batch smaller than the number of ranks, every rank must still get a
// sample in every step, and every sample must still be used once per epoch.
TEST(Trainer, SyncBatchNormKeepsEveryRankInEveryStepDespiteASlowRankAndATinyLastBatch) {
  for (int world : {2, 3}) {
    const std::string dir = hddp::testing::makeTempDir();
    const int64_t B = 16;
    const int64_t N = 3 * B + world - 1;  // the last batch (world - 1) is below world
    const int epochs = 2;
    runThreads(world, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      SyncNet model;
      hddp::convertSyncBatchNorm(*model, *comm);  // attaches the communicator
      torch::optim::SGD opt(model->parameters(), 0.01);
      hddp::TrainerOptions o;
      o.globalBatch = B;
      o.epochs = epochs;
      o.progress = hddp::ProgressMode::Off;
      o.planner.rebalanceEvery = 2;
      o.metricsPath = dir + "/m.jsonl";
      hddp::EmulationOptions slow;
      slow.slowdown = rank == 1 ? 10.0 : 1.0;
      o.emulation = slow;
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(N, 1, 8, 4);
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt,
                            ds, o);
      trainer.fit();
    });
    int64_t samples = 0;
    int64_t steps = 0;
    for (int r = 0; r < world; ++r) {
      std::ifstream in(r == 0 ? dir + "/m.jsonl" : dir + "/m.rank" + std::to_string(r) + ".jsonl");
      for (std::string line; std::getline(in, line);) {
        auto rec = nlohmann::json::parse(line);
        if (rec.value("kind", "") != "step") {
          continue;
        }
        ++steps;
        samples += rec.at("local_batch").get<int64_t>();
        EXPECT_GE(rec.at("local_batch").get<int64_t>(), 1)
            << "world " << world << ", rank " << r << ": " << line;
      }
    }
    EXPECT_EQ(samples, epochs * N) << "world " << world;
    EXPECT_EQ(steps, world * epochs * 3) << "world " << world << ": the tiny rest joins a step";
  }
}

TEST(Trainer, RefusesBadOptions) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto bad = [&](const std::function<void(hddp::TrainerOptions&)>& configure) {
      try {
        trainRun(rank, size, store, configure);
      } catch (const hddp::ConfigError& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("(no ConfigError)");
    };
    EXPECT_NE(bad([](hddp::TrainerOptions& o) { o.amp = hddp::AmpMode::Fp16; }).find("needs a GPU"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) { o.saveEvery = 5; }).find("saveDir"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) { o.keepLast = 0; }).find("keepLast"),
              std::string::npos);
    // Given memory caps: one per rank, and with the equal split the share must fit.
    EXPECT_NE(bad([](hddp::TrainerOptions& o) {
                o.maxLocalBatch = {8, 8};
              }).find("maxLocalBatch has 2 entries for 1 ranks"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) {
                o.maxLocalBatch = {8};
              }).find("equal share of the global batch 24 is 24"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) {
                o.balance = true;
                o.maxLocalBatch = {8};
              }).find("fewer than the global batch 24"),
              std::string::npos);
  });
  EXPECT_THROW(hddp::parseAmpMode("fp8"), hddp::ConfigError);
  EXPECT_EQ(hddp::parseAmpMode("bf16"), hddp::AmpMode::Bf16);
}

namespace {

// A linear classifier whose weight is also registered under a second name when `tie`
// is set: LibTorch's parameters() then lists that tensor twice.
struct TiedNetImpl : torch::nn::Module {
  explicit TiedNetImpl(bool tie) {
    fc = register_module("fc", torch::nn::Linear(64, 4));
    if (tie) {
      register_parameter("alias", fc->weight);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x.flatten(1)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TiedNet);

}  // namespace

// Gradient clipping counts a tied weight once (PyTorch de-duplicates; a weight counted
// twice inflates the norm and shrinks the clipped step): one step with clipping on the
// tied model equals the same model with the weight registered once. An optimizer
// built from parameters() of the tied model, which would step the weight twice, is
// refused with the fix in the message.
TEST(Trainer, ClippingCountsATiedWeightOnceAndAnOptimizerListingItTwiceIsRefused) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(48, 1, 8, 4, /*seed=*/1);
    hddp::TrainerOptions o;
    o.globalBatch = 24;
    o.maxSteps = 1;
    o.balance = false;
    o.clipGradNorm = 0.05;  // well under the gradient's norm: clipping acts
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    auto train = [&](bool tie) {
      torch::manual_seed(11);
      TiedNet model(tie);
      torch::optim::SGD opt(hddp::uniqueParameters(*model), torch::optim::SGDOptions(1.0));
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt,
                            ds, o);
      trainer.fit();
      return model->fc->weight.detach().clone();
    };
    const auto once = train(false);
    const auto tied = train(true);
    EXPECT_TRUE(torch::allclose(once, tied, 1e-6, 1e-7))
        << "max diff " << (once - tied).abs().max().item<double>();
    torch::manual_seed(11);
    TiedNet model(true);
    torch::optim::SGD twice(model->parameters(), torch::optim::SGDOptions(1.0));
    try {
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), twice,
                            ds, o);
      ADD_FAILURE() << "an optimizer listing a tied weight twice was accepted";
    } catch (const hddp::ConfigError& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("uniqueParameters"), std::string::npos) << message;
      EXPECT_NE(message.find("'alias'"), std::string::npos) << message;
    }
  });
}
