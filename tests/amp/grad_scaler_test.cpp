#include "hddp/amp/grad_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "hddp/core/autocast.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/emulated_device.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

std::vector<torch::Tensor> grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) {
    out.push_back(p.grad().clone());
  }
  return out;
}

TEST(GradScaler, UnscaledGradientsEqualPlainGradients) {
  torch::manual_seed(0);
  torch::nn::Linear plain(6, 3);
  torch::nn::Linear scaled(6, 3);
  {
    torch::NoGradGuard g;
    scaled->weight.copy_(plain->weight);
    scaled->bias.copy_(plain->bias);
  }
  auto x = torch::randn({5, 6});
  plain(x).pow(2).mean().backward();
  hddp::GradScaler scaler;
  torch::optim::SGD opt(scaled->parameters(), 0.1);
  scaler.scale(scaled(x).pow(2).mean()).backward();
  EXPECT_FALSE(torch::allclose(scaled->weight.grad(), plain->weight.grad()))
      << "the loss was not scaled";
  scaler.unscale(opt);
  auto a = grads(*plain);
  auto b = grads(*scaled);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-7))
        << i;  // power-of-two scale: exact up to rounding
  }
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.currentScale(), 65536.0);
  EXPECT_EQ(scaler.growthTracker(), 1);
}

// A tensor listed twice (a tied weight: parameters() lists it once per name) is
// unscaled once, as PyTorch's GradScaler does.
TEST(GradScaler, ATensorListedTwiceIsUnscaledOnce) {
  hddp::GradScalerOptions o;
  o.initScale = 8;
  hddp::GradScaler scaler(o);
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt({w, w}, 0.1);
  scaler.scale((w * 2).sum()).backward();  // gradient 2 x 8
  scaler.unscale(opt);
  EXPECT_TRUE(torch::allclose(w.grad(), torch::full({3}, 2.0))) << w.grad();
}

TEST(GradScaler, GrowsAfterTheIntervalAndBacksOffOnInf) {
  hddp::GradScalerOptions o;
  o.initScale = 8;
  o.growthInterval = 3;
  hddp::GradScaler scaler(o);
  auto w = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({w}, 0.1);
  auto iteration = [&](float value) {
    opt.zero_grad();
    scaler.scale((w * value).sum()).backward();
    const bool stepped = scaler.step(opt);
    scaler.update();
    return stepped;
  };
  EXPECT_TRUE(iteration(1));
  EXPECT_TRUE(iteration(1));
  EXPECT_EQ(scaler.currentScale(), 8);
  EXPECT_TRUE(iteration(1));
  EXPECT_EQ(scaler.currentScale(), 16) << "no growth after growthInterval good steps";
  auto before = w.detach().clone();
  EXPECT_FALSE(iteration(std::numeric_limits<float>::infinity()));
  EXPECT_EQ(scaler.currentScale(), 8) << "no backoff after an inf";
  EXPECT_TRUE(w.detach().equal(before)) << "the step was not skipped";
  EXPECT_FALSE(iteration(std::nanf("")));
  EXPECT_EQ(scaler.currentScale(), 4);
}

TEST(GradScaler, InfOnOneRankMakesEveryRankSkipAndBackOff) {
  runThreads(3, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto w = torch::ones({4}, torch::requires_grad());
    torch::optim::SGD opt({w}, 0.1);
    hddp::GradScaler scaler({}, comm.get());
    scaler.scale(w.sum()).backward();
    if (rank == 1) {
      torch::NoGradGuard g;
      w.mutable_grad()[2] = std::numeric_limits<float>::infinity();  // a local overflow
    }
    EXPECT_FALSE(scaler.step(opt)) << "rank " << rank << " stepped although rank 1 overflowed";
    scaler.update();
    EXPECT_EQ(scaler.currentScale(), 32768.0);
    EXPECT_TRUE(w.detach().equal(torch::ones({4})));
  });
}

TEST(GradScaler, WithDdpAndBf16AutocastTrainsAndStateRoundTrips) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(rank);
    torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                                torch::nn::Linear(16, 2));
    hddp::DistributedDataParallel ddp(model, *comm);
    torch::optim::SGD opt(model->parameters(), 0.05);
    hddp::GradScaler scaler({}, comm.get());
    auto x = torch::randn({16, 8});
    auto y = (x.sum(1) > 0).to(torch::kLong);
    double first = 0;
    double last = 0;
    for (int s = 0; s < 30; ++s) {
      opt.zero_grad();
      torch::Tensor loss;
      {
        hddp::AutocastGuard amp(c10::kCPU);
        loss = torch::cross_entropy_loss(model->forward(x), y);
      }
      scaler.scale(loss).backward();
      EXPECT_TRUE(scaler.step(opt));
      scaler.update();
      (s == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, first);
    torch::serialize::OutputArchive out;
    scaler.save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    hddp::GradScaler restored;
    torch::serialize::InputArchive in;
    std::istringstream is(bytes.str());
    in.load_from(is);
    restored.load(in);
    EXPECT_EQ(restored.currentScale(), scaler.currentScale());
    EXPECT_EQ(restored.growthTracker(), scaler.growthTracker());
  });
}

// A saved state with a value the constructor would refuse, or an entry missing, is a
// StateError naming it, and the scaler keeps its scale, tracker and options.
TEST(GradScaler, ALoadOfADamagedStateIsRefusedAndChangesNothing) {
  const auto saved = [](const std::string& key, double value) {
    hddp::GradScalerOptions o;
    o.initScale = 1024;
    torch::serialize::OutputArchive out;
    hddp::GradScaler(o).save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    std::istringstream is(bytes.str());
    in.load_from(is);
    // Rewritten with `key` set to `value` (or left out when value is NaN).
    torch::serialize::OutputArchive edited;
    for (const auto& k : in.keys()) {
      at::Tensor t;
      in.read(k, t);
      if (k != key) {
        edited.write(k, t);
      } else if (!std::isnan(value)) {
        edited.write(k, at::full({1}, value, t.scalar_type()));
      }
    }
    std::ostringstream again;
    edited.save_to(again);
    auto result = std::make_shared<torch::serialize::InputArchive>();
    std::istringstream back(again.str());
    result->load_from(back);
    return result;
  };
  const std::vector<std::pair<std::string, double>> damaged = {
      {"growth_interval", 0}, {"growth_factor", 1.0},  {"backoff_factor", 1.5},  {"scale", -2.0},
      {"scale", 1e300},       {"growth_tracker", 5e9}, {"enabled", std::nan("")}};
  for (const auto& [key, value] : damaged) {
    hddp::GradScalerOptions o;
    o.initScale = 8;
    o.growthInterval = 7;
    hddp::GradScaler scaler(o);
    auto archive = saved(key, value);
    try {
      scaler.load(*archive);
      ADD_FAILURE() << key << " = " << value << " was loaded";
    } catch (const hddp::StateError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
    EXPECT_EQ(scaler.currentScale(), 8.0) << key;
    EXPECT_EQ(scaler.options().growthInterval, 7) << key;
  }
}

TEST(GradScaler, MisuseIsReported) {
  hddp::GradScaler scaler;
  auto w = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt({w}, 0.1);
  scaler.scale(w.sum()).backward();
  scaler.unscale(opt);
  EXPECT_THROW(scaler.unscale(opt), hddp::Error);  // twice in one step
  EXPECT_THROW(hddp::GradScaler(hddp::GradScalerOptions{-1.0}), hddp::Error);
}

// 65536 is inf in float16: the scale must stay float32 and promote the loss.
TEST(GradScaler, Fp16LossIsScaledInFloat32) {
  hddp::GradScaler scaler;
  auto scaled = scaler.scale(torch::full({}, 1.5, torch::kHalf));
  EXPECT_EQ(scaled.scalar_type(), torch::kFloat);
  EXPECT_EQ(scaled.item<double>(), 1.5 * 65536.0);
}

// A rank with no samples in the first step never calls scale(); it must still unscale
// the gradients it receives and join the found-inf agreement, not throw while the other
// ranks wait in it.
TEST(GradScaler, ARankWithoutSamplesBeforeItsFirstScaleStepsWithTheOthers) {
  std::vector<std::vector<torch::Tensor>> weights(2);
  std::vector<int> stepped(2, -1);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(3);
    torch::nn::Linear model(4, 2);
    hddp::DistributedDataParallel ddp(model, *comm);
    torch::optim::SGD opt(model->parameters(), 0.1);
    hddp::GradScaler scaler({}, comm.get());
    ddp.setBatch(rank == 0 ? 4 : 0, 4);
    if (rank == 0) {
      scaler.scale(model(torch::ones({4, 4})).pow(2).mean()).backward();
    } else {
      ddp.finalize();
    }
    stepped[rank] = scaler.step(opt) ? 1 : 0;
    scaler.update();
    for (auto& p : model->parameters()) {
      weights[rank].push_back(p.detach().clone());
    }
  });
  EXPECT_EQ(stepped[0], 1);
  EXPECT_EQ(stepped[1], 1);
  ASSERT_EQ(weights[0].size(), weights[1].size());
  for (size_t i = 0; i < weights[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(weights[0][i], weights[1][i])) << "parameter " << i;
  }
}

// fp16 autocast on a device: an initial scale that overflows float16 makes the scaler
// skip steps and back off, then training goes on.
void fp16TrainingSkipsOverflowAndRecovers(const c10::Device& device) {
  torch::manual_seed(0);
  torch::nn::Linear model(32, 4);
  model->to(device);
  torch::optim::SGD opt(model->parameters(), 0.01);
  hddp::GradScalerOptions o;
  o.initScale = 1e30;  // overflows float16 at once: the scaler must back off
  hddp::GradScaler scaler(o);
  auto x = torch::randn({64, 32}).to(device);
  auto y = torch::randint(0, 4, {64}, torch::TensorOptions().dtype(torch::kLong)).to(device);
  int skipped = 0;
  for (int s = 0; s < 200; ++s) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      hddp::AutocastGuard amp(device.type());
      loss = torch::cross_entropy_loss(model(x), y);
      EXPECT_EQ(model(x).scalar_type(), torch::kHalf);
    }
    scaler.scale(loss).backward();
    skipped += scaler.step(opt) ? 0 : 1;
    scaler.update();
  }
  EXPECT_GT(skipped, 0);
  EXPECT_LT(scaler.currentScale(), 1e30);
  EXPECT_LT(skipped, 200);
  EXPECT_EQ(model->weight.device(), device);
}

void bf16AutocastTrainsWithoutScaler(const c10::Device& device) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 4));
  model->to(device);
  torch::optim::SGD opt(model->parameters(), 0.05);
  hddp::GradScaler disabled(hddp::GradScalerOptions{65536.0, 2.0, 0.5, 2000, /*enabled=*/false});
  auto x = torch::randn({128, 32}).to(device);
  auto y = (x.sum(1) > 0).to(torch::kLong);
  double first = 0;
  double last = 0;
  for (int s = 0; s < 50; ++s) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      hddp::AutocastGuard amp(device.type(), c10::kBFloat16);
      auto out = model->forward(x);
      EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
      loss = torch::cross_entropy_loss(out, y);
    }
    disabled.scale(loss).backward();
    EXPECT_TRUE(disabled.step(opt));
    disabled.update();
    (s == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.7 * first);
}

TEST(GradScaler, Fp16TrainingSkipsOverflowAndRecovers_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  fp16TrainingSkipsOverflowAndRecovers(c10::Device(c10::kCUDA, 0));
}

TEST(GradScaler, Fp16TrainingSkipsOverflowAndRecovers_Emu) {
  fp16TrainingSkipsOverflowAndRecovers(hddp::testing::emulatedDevice(0));
}

TEST(GradScaler, Bf16AutocastTrainsWithoutScaler_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  bf16AutocastTrainsWithoutScaler(c10::Device(c10::kCUDA, 0));
}

TEST(GradScaler, Bf16AutocastTrainsWithoutScaler_Emu) {
  bf16AutocastTrainsWithoutScaler(hddp::testing::emulatedDevice(0));
}

}  // namespace
