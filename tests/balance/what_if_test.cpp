// What-if planning (hddp/balance/what_if.h) and the model profile it reads
// (hddp/train/model_profile.h): a golden case derived by hand, the ring model against
// its formula, the split equal to the solver's, calibration scaling, precision
// fallback, profile files, FLOPs and activation memory counted from real modules, and
// ZeRO's shards in the memory model (WhatIfZero).
#include "hddp/balance/what_if.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "hddp/balance/cost_model.h"
#include "hddp/core/error.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "hddp/train/model_profile.h"
#include "resnet.h"
#include "support/emulated_device.h"
#include "support/what_if_golden.h"

namespace {

// Two cards and two links, figures chosen to be worked out by hand below.
hddp::DeviceTable goldenTable() {
  return hddp::DeviceTable::parse(hddp::testing::goldenTableJson(), "golden.json");
}

using hddp::testing::goldenProfile;

hddp::WhatIfSettings goldenSettings() {
  hddp::WhatIfSettings s;
  s.globalBatch = 256;
  s.efficiency = 0.5;
  s.memoryTraffic = 0;  // the golden case counts products only
  s.optimizerStateCopies = 1;
  s.memoryHeadroom = 0.10;
  s.contextBytes = 512.0 * (1 << 20);
  s.prefetch = true;
  s.firstBucketBytes = 1.0 * (1 << 20);
  s.bucketBytes = 25.0 * (1 << 20);
  return s;
}

bool hasAdvice(const hddp::WhatIfResult& r, const std::string& text) {
  for (const auto& a : r.advice) {
    if (a.find(text) != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::string adviceText(const hddp::WhatIfResult& r) {
  std::string all;
  for (const auto& a : r.advice) {
    all += a + "\n";
  }
  return all;
}

// By hand, fast on wide and slow on narrow, B = 256:
//   compute   fast 2e9 / (10e12 x 0.5) = 0.4 ms/sample;  slow 2e9 / (5e12 x 0.5) = 0.8 ms
//   fixed     (3 + 2 x 1) x 1e8 B / memory bandwidth: fast 5e8 / 100e9 = 5 ms; slow 10 ms
//   input     5e5 B / 10 GB/s = 0.05 ms; / 1 GB/s = 0.5 ms: both under compute, hidden
//   memory    fixed 3 x 1e8 B = 286.10 MiB; budget = total x 0.9 - 512 MiB context
//             fast (9216 - 512 - 286.10) / 32 = 263.06 -> 263
//             slow (2764.8 - 512 - 286.10) / 32 = 61.46 -> 61
//   split     unconstrained slow would take 81 (5 + 0.4 a = 10 + 0.8 b): capped at 61,
//             fast 195: 5 + 78 = 83 ms, slow 10 + 48.8 = 58.8 ms
//   allreduce ring 2 x (1/2) x 1e8 B / 1 GB/s (the narrow link) = 100 ms; backward of the
//             slowest rank (fast) 2/3 x 78 = 52 ms; buckets 1 MiB, 3 x 25 MiB and the
//             last 1e8 - 1048576 - 3 x 26214400 = 20308224 B: 20.3 ms that cannot hide;
//             exposed max(100 - 52, 20.3) = 48 ms
//   step      83 + 48 = 131 ms: 256 / 0.131 = 1954.2 samples/s
//   peers     equal split 128 > slow's cap 61: out of memory
//             fast alone 5 + 256 x 0.4 = 107.4 ms: 2383.6 samples/s (cap 263 >= 256)
//             slow alone ceil(256 / 61) = 5 micro-batches: 5 x 10 + 256 x 0.8 = 254.8 ms
//   verdict   the narrow link's allreduce costs more than the slow card gives:
//             1 - 1954.2 / 2383.6 = 18% slower than the fast card alone
TEST(WhatIf, AGoldenCaseWorkedOutByHand) {
  const auto table = goldenTable();
  const auto mix = table.parseMix("fast@wide,slow@narrow");
  const auto r = hddp::predictMix(mix, goldenProfile(), goldenSettings(), table);
  ASSERT_EQ(r.devices.size(), 2u);
  EXPECT_NEAR(r.devices[0].cost.secondsPerSample, 0.4e-3, 1e-12);
  EXPECT_NEAR(r.devices[1].cost.secondsPerSample, 0.8e-3, 1e-12);
  EXPECT_NEAR(r.devices[0].cost.fixedSeconds, 5e-3, 1e-12);
  EXPECT_NEAR(r.devices[1].cost.fixedSeconds, 10e-3, 1e-12);
  EXPECT_NEAR(r.devices[1].cost.transferSecondsPerSample(), 0.5e-3, 1e-12);
  EXPECT_EQ(r.devices[0].memoryCap, 263);
  EXPECT_EQ(r.devices[1].memoryCap, 61);
  EXPECT_EQ(r.plan.local, (std::vector<int64_t>{195, 61}));
  EXPECT_NEAR(r.devices[0].stepSeconds, 0.083, 1e-9);
  EXPECT_NEAR(r.devices[1].stepSeconds, 0.0588, 1e-9);
  EXPECT_NEAR(r.allreduceSeconds, 0.100, 1e-9);
  EXPECT_NEAR(r.exposedAllreduceSeconds, 0.048, 1e-9);
  EXPECT_NEAR(r.stepSeconds, 0.131, 1e-9);
  EXPECT_NEAR(r.samplesPerSecond, 256 / 0.131, 1e-6);
  EXPECT_EQ(r.equalSplitSamplesPerSecond, 0.0) << "128 samples exceed the slow card's 61";
  EXPECT_EQ(r.fastest, 0);
  EXPECT_NEAR(r.fastestAloneSamplesPerSecond, 256 / 0.1074, 1e-6);
  EXPECT_TRUE(hasAdvice(r, "the slow on narrow slows the rest of the mix by 18%")) << adviceText(r);
  EXPECT_TRUE(hasAdvice(r,
                        "hddp's split trains 1954 samples/s; PyTorch DDP's equal split would "
                        "run out of memory (slow 128 samples where its memory holds 61), 18% "
                        "less than the fast alone (2384 samples/s)"))
      << adviceText(r);
  EXPECT_TRUE(hasAdvice(r, "memory caps the slow at 61 samples in fp32")) << adviceText(r);
  EXPECT_TRUE(hasAdvice(r, "equal split would run out of memory (slow 128 samples"))
      << adviceText(r);
  EXPECT_TRUE(hasAdvice(r, "allreduce over it takes 100.0 ms per step, 48.0 ms of it exposed"))
      << adviceText(r);

  // On the wide link too, the allreduce is 1e8 / 10e9 = 10 ms, of which only the last
  // bucket (0.20308224 x 10 = 2.03 ms) is exposed: 85.03 ms a step, 3010.7 samples/s,
  // 26% over fast alone.
  const auto wide = hddp::predictMix(table.parseMix("fast@wide,slow@wide"), goldenProfile(),
                                     goldenSettings(), table);
  EXPECT_NEAR(wide.exposedAllreduceSeconds, 0.0020308224, 1e-9);
  EXPECT_NEAR(wide.stepSeconds, 0.0850308224, 1e-9);
  EXPECT_TRUE(hasAdvice(wide, "the slow on wide adds 26% to the rest of the mix"))
      << adviceText(wide);
}

TEST(WhatIf, TheRingModelIsItsFormula) {
  // Each rank sends and receives 2 (n - 1) / n of the bytes over the slowest link.
  EXPECT_DOUBLE_EQ(hddp::ringAllreduceSeconds(1e8, 4, 1e9), 2.0 * 3 / 4 * 1e8 / 1e9);
  EXPECT_DOUBLE_EQ(hddp::ringAllreduceSeconds(1e8, 2, 2.8e9), 1e8 / 2.8e9);
  EXPECT_EQ(hddp::ringAllreduceSeconds(1e8, 1, 1e9), 0.0) << "one rank reduces nothing";
  EXPECT_EQ(hddp::ringAllreduceSeconds(1e8, 3, 0.0), 0.0) << "no link term";
  const auto table = goldenTable();
  for (const char* spec : {"fast@narrow,slow@wide,fast@wide", "fast@wide,fast@wide"}) {
    auto profile = goldenProfile();
    profile.activationBytesPerSample = 0;  // no caps
    const auto mix = table.parseMix(spec);
    const auto r = hddp::predictMix(mix, profile, goldenSettings(), table);
    double slowest = 1e30;
    for (const auto& e : mix) {
      slowest = std::min(slowest, e.link.GBps * 1e9);
    }
    EXPECT_DOUBLE_EQ(r.allreduceSeconds,
                     2.0 * (mix.size() - 1.0) / mix.size() * profile.parameterBytes / slowest)
        << spec;
  }
}

TEST(WhatIf, TheSplitIsTheSolversOnTheSameCosts) {
  const auto table = hddp::DeviceTable::load(HDDP_TEST_DEVICE_TABLE);
  auto profile = goldenProfile();
  for (const char* spec : {"rtx4090@pcie4x16,rtx3060@tb3", "rtx3090,rtx3080@pcie3x4,t4@usb4",
                           "h100@pcie5x16,l4@pcie4x8,rtx2080ti@tb3,a100"}) {
    for (hddp::AmpMode amp : {hddp::AmpMode::Off, hddp::AmpMode::Bf16}) {
      profile.amp = amp;
      auto settings = goldenSettings();
      settings.globalBatch = 300;
      const auto mix = table.parseMix(spec);
      const auto r = hddp::predictMix(mix, profile, settings, table);
      const auto costs = hddp::whatIfCosts(mix, profile, settings, table);
      EXPECT_EQ(r.plan.local, hddp::solveSplit(costs, 300).local) << spec;
      EXPECT_DOUBLE_EQ(r.plan.predictedStepSeconds,
                       hddp::solveSplit(costs, 300).predictedStepSeconds);
    }
  }
}

TEST(WhatIf, ACalibrationScalesByThePeakRatiosAndAMissingPathFallsBackToFp32) {
  const auto table = goldenTable();
  auto profile = goldenProfile();
  profile.amp = hddp::AmpMode::Bf16;
  profile.calibratedOn = "fast";
  profile.calibratedSecondsPerSample = 1e-3;
  profile.calibratedFixedSeconds = 4e-3;
  const auto costs =
      hddp::whatIfCosts(table.parseMix("fast@wide,slow@wide"), profile, goldenSettings(), table);
  // Neither card has a bf16 path: both at fp32, 10 vs 5 TFLOPS; memory 100 vs 50 GB/s.
  EXPECT_DOUBLE_EQ(costs[1].secondsPerSample, 2e-3);
  EXPECT_DOUBLE_EQ(costs[1].fixedSeconds, 8e-3);
  const auto r =
      hddp::predictMix(table.parseMix("fast@wide,slow@wide"), profile, goldenSettings(), table);
  EXPECT_TRUE(hasAdvice(r,
                        "the slow has no bf16 tensor path: predicted at its fp32 rate (5.0 "
                        "TFLOPS); --amp fp16 would use its 20.0 TFLOPS"))
      << adviceText(r);
  EXPECT_FALSE(hasAdvice(r, "(--efficiency)")) << "a calibrated profile needs no guess";
  // fp16: the slow card's 20 TFLOPS tensor path against the fast card's fp32 10.
  profile.amp = hddp::AmpMode::Fp16;
  EXPECT_DOUBLE_EQ(
      hddp::whatIfCosts(table.parseMix("slow@wide"), profile, goldenSettings(), table)[0]
          .secondsPerSample,
      0.5e-3);
  profile.calibratedOn = "rtx9090";
  EXPECT_THROW(hddp::whatIfCosts(table.parseMix("slow@wide"), profile, goldenSettings(), table),
               hddp::ConfigError);
}

TEST(WhatIf, AMixThatCannotHoldTheBatchIsAnErrorThatSaysWhatToDo) {
  const auto table = goldenTable();
  auto settings = goldenSettings();
  settings.globalBatch = 1000;  // caps 263 + 61
  try {
    hddp::predictMix(table.parseMix("fast@wide,slow@wide"), goldenProfile(), settings, table);
    FAIL() << "no error";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("the mix's memory holds 324 samples of golden per step, "
                                         "fewer than the global batch of 1000: lower "
                                         "--global-batch, use --amp, or add a device"),
              std::string::npos)
        << e.what();
  }
}

TEST(WhatIf, AProfileFileRoundTripsAndBadFieldsAreNamed) {
  auto p = goldenProfile();
  p.forwardFlopsPerSample = 0.7e9;
  p.amp = hddp::AmpMode::Fp16;
  p.calibratedOn = "rtx3060";
  p.calibratedSecondsPerSample = 2.5e-3;
  p.calibratedFixedSeconds = 0.01;
  const auto q = hddp::ModelProfile::fromJson(p.toJson(), "p.json");
  EXPECT_EQ(q.model, p.model);
  EXPECT_EQ(q.trainFlopsPerSample, p.trainFlopsPerSample);
  EXPECT_EQ(q.activationBytesPerSample, p.activationBytesPerSample);
  EXPECT_EQ(q.amp, hddp::AmpMode::Fp16);
  EXPECT_EQ(q.calibratedOn, "rtx3060");
  EXPECT_EQ(q.calibratedFixedSeconds, 0.01);
  std::string bad = p.toJson();
  bad.replace(bad.find("\"parameter_bytes\""), 17, "\"parameters\"");
  try {
    hddp::ModelProfile::fromJson(bad, "p.json");
    FAIL() << "no error";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("p.json: parameter_bytes must be a number >= 0"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(hddp::ModelProfile::fromJson("{", "p.json"), hddp::ConfigError);
}

// FLOPs by hand: a 3x3 convolution's forward is 2 x N x weight elements x output pixels;
// its backward costs as much again for the weight's gradient and again for the input's,
// which the first layer does not need.
TEST(ModelProfile, FlopsAreCountedFromTheModulesShapes) {
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1)),
                            torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                            torch::nn::Flatten(), torch::nn::Linear(4 * 5 * 5, 10));
  const auto flops = hddp::countFlops([&](const at::Tensor& x) { return net->forward(x); },
                                      torch::randn({2, 2, 5, 5}));
  const double conv1 = 2.0 * 2 * (3 * 2 * 9) * 25;  // 5400
  const double conv2 = 2.0 * 2 * (4 * 3 * 9) * 25;  // 10800
  const double linear = 2.0 * 2 * 100 * 10;         // 4000
  EXPECT_DOUBLE_EQ(flops.forward, conv1 + conv2 + linear);
  // Backward: linear (input and weight), conv2 (input and weight), conv1 (weight only).
  EXPECT_DOUBLE_EQ(flops.backward, 2 * linear + 2 * conv2 + conv1);
}

TEST(ModelProfile, ActivationMemoryAndParametersComeFromTheModel) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(1000, 1000), torch::nn::ReLU(),
                            torch::nn::Linear(1000, 10));
  hddp::ProfileOptions o;
  o.model = "mlp";
  o.sampleShape = {1000};
  o.memoryBatch = 16;
  o.calibrateOn = "here";
  o.calibrationBatch = 16;
  o.calibrationSteps = 3;
  const auto p = hddp::profileModel([&](const at::Tensor& x) { return net->forward(x); },
                                    net->parameters(), o);
  EXPECT_DOUBLE_EQ(p.parameterBytes, 4.0 * (1000 * 1000 + 1000 + 1000 * 10 + 10));
  EXPECT_DOUBLE_EQ(p.inputBytesPerSample, 4000.0);
  EXPECT_EQ(p.gradientShapes,
            (std::vector<std::vector<int64_t>>{{1000, 1000}, {1000}, {10, 1000}, {10}}));
  EXPECT_DOUBLE_EQ(p.forwardFlopsPerSample, 2.0 * (1000 * 1000 + 1000 * 10));
  // Backward: the first layer's weight only, the second's weight and input.
  EXPECT_DOUBLE_EQ(p.trainFlopsPerSample, 2.0 * (2 * 1000 * 1000 + 3 * 1000 * 10));
  // Per sample the step holds its input, the first layer's output and the ReLU's
  // (4000 B each), then their gradients: between 2 and 6 such vectors.
  EXPECT_GE(p.activationBytesPerSample, 8000.0);
  EXPECT_LE(p.activationBytesPerSample, 24000.0);
  EXPECT_EQ(p.calibratedOn, "here");
  EXPECT_GT(p.calibratedSecondsPerSample, 0.0);
  EXPECT_EQ(net->parameters()[0].device().type(), c10::kCPU);
}

// The calibration times the model on a device (device-generic synchronisation) and
// puts the weights back where they were.
hddp::ModelProfile calibrateOn(const c10::Device& device, int64_t batch) {
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 3).padding(1)),
                            torch::nn::ReLU(), torch::nn::Flatten(),
                            torch::nn::Linear(64 * 32 * 32, 10));
  hddp::ProfileOptions o;
  o.sampleShape = {3, 32, 32};
  o.amp = hddp::AmpMode::Bf16;
  o.calibrateOn = "h200";
  o.device = device;
  o.calibrationBatch = batch;
  o.moveTo = [&](const c10::Device& d) { net->to(d); };
  const auto p = hddp::profileModel([&](const at::Tensor& x) { return net->forward(x); },
                                    net->parameters(), o);
  EXPECT_GT(p.calibratedSecondsPerSample, 0.0);
  EXPECT_EQ(net->parameters()[0].device().type(), c10::kCPU);
  std::printf("calibrated on %s: %.3f us/sample + %.3f ms\n", device.str().c_str(),
              p.calibratedSecondsPerSample * 1e6, p.calibratedFixedSeconds * 1e3);
  return p;
}

TEST(ModelProfile, CalibratesOnACudaCard_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device on this machine (runs on a GPU machine via tools/gpu-check.sh)";
  }
  const auto p = calibrateOn(c10::Device(c10::kCUDA, 0), 64);
  EXPECT_LT(p.calibratedSecondsPerSample, 1e-3) << "a small net on a GPU";
}

// On an emulated card 5x slower than another, the calibration measures it about 5x
// slower (emu sleeps four times each operator's compute time); at least 2x, so that a
// timing disturbed by other processes does not fail the test. The comparison is of a
// whole step at the calibration batch (fixed part plus per-sample part): the split
// between the two comes from two batch sizes and moves with load (a CI run measured
// the slow card's per-sample part alone at under 2x), their sum does not.
TEST(ModelProfile, CalibratesOnAnEmulatedCard_Emu) {
  const c10::Device fast = hddp::testing::emulatedDevice(0);
  const c10::Device slow(c10::DeviceType::PrivateUse1, 1);
  hddp::emu::setSlowdown(1, 5.0);
  const int64_t batch = 8;
  const auto a = calibrateOn(fast, batch);
  const auto b = calibrateOn(slow, batch);
  auto step = [batch](const hddp::ModelProfile& p) {
    return p.calibratedFixedSeconds + p.calibratedSecondsPerSample * static_cast<double>(batch);
  };
  const double ratio = step(b) / step(a);
  EXPECT_GT(ratio, 2.0) << "emu:1 is 5x slower";
  EXPECT_GT(hddp::emu::counters(1).slowdownSeconds, 0.0);
}

// Without a calibration the prediction is a guess; its default efficiency and memory
// traffic are fitted to training figures others published for cards of the table
// (data/devices.json's "published" list, each with its source; bench/what_if_fit.py).
// Every figure is predicted within the uncertainty the tool prints, and that is within
// 25% (issue #32, item 21; at the old 40% of peak the RTX 4090 was 52% high).
TEST(WhatIf, UncalibratedPredictionsMatchPublishedFigures) {
  const auto table = hddp::DeviceTable::load(HDDP_TEST_DEVICE_TABLE);
  const auto& figures = table.published();
  std::set<std::string> cards;
  for (const auto& f : figures) {
    cards.insert(f.device);
  }
  ASSERT_GE(figures.size(), 3u);
  ASSERT_GE(cards.size(), 3u);
  const hddp::WhatIfSettings defaults;
  EXPECT_LE(defaults.uncertainty, 0.25);
  std::map<std::string, hddp::ModelProfile> profiles;
  for (const auto& f : figures) {
    SCOPED_TRACE(f.device + " " + f.model + " " + f.amp + ": " + f.source);
    ASSERT_EQ(f.model, "resnet50") << "this test profiles the example ResNets only";
    ASSERT_EQ(f.input, "3x224x224");
    auto& p = profiles[f.model + f.input + f.amp];
    if (p.model.empty()) {
      torch::manual_seed(0);
      hddp::models::ResNetOptions mo;
      mo.arch = f.model;
      mo.imageSize = 224;
      mo.numClasses = 1000;  // ImageNet, as the published runs
      hddp::models::ResNet net(mo);
      hddp::ProfileOptions o;
      o.model = f.model + " " + f.input;
      o.sampleShape = {3, 224, 224};
      o.amp = hddp::parseAmpMode(f.amp);
      p = hddp::profileModel([&](const at::Tensor& x) { return net->forward(x); },
                             net->parameters(), o);
    }
    hddp::WhatIfSettings s;
    s.globalBatch = f.batch;
    hddp::MixEntry e;
    e.device = table.device(f.device);
    e.link = table.link("pcie4x16");
    // A batch the card holds (the V100's 16 GB hold 175 samples in float32, fewer than
    // the 256 its script defaults to).
    s.globalBatch = std::min(f.batch, hddp::whatIfCosts({e}, p, s, table)[0].maxSamples);
    const auto r = hddp::predictMix({e}, p, s, table);
    const double error = r.samplesPerSecond / f.samplesPerSecond - 1.0;
    EXPECT_LE(std::abs(error), defaults.uncertainty)
        << "predicted " << r.samplesPerSecond << " samples/s, published " << f.samplesPerSecond;
  }
}

}  // namespace

namespace {

// The golden profile's 1e8 bytes as five 5000 x 1000 weights (20 MB each).
hddp::ModelProfile goldenWithShapes() {
  auto p = goldenProfile();
  p.gradientShapes.assign(5, {5000, 1000});
  return p;
}

}  // namespace

// The golden case (fast@wide, slow@narrow; compute 83 ms, backward 52 ms) with the
// gradients compressed, by hand:
//   fp16        50 MB over 1 GB/s: 50 ms, within backward; the last bucket (20.3 MB of
//               the 100, as before) shows: 10.15 ms exposed, a step of 93.15 ms
//   powersgd:4  each 5000 x 1000 weight sends (5000 + 1000) x 4 floats: 0.48 MB, 0.48 ms;
//               the last bucket's share by bytes as for the others (0.20308224), and
//               Q (1000 x 4 of each weight's 24000) a sixth, sent after backward:
//               0.48 x (0.20308224 + 1/6) = 0.17748 ms exposed; compute on
//               the slow card (the slower of the two): 5 x (3 x 2 x 5000 x 1000 x 4 +
//               2 x 5000 x 16) FLOPs / (5 TFLOPS x 0.5) = 0.24032 ms, plus 8 passes over
//               the 1e8 bytes / 50 GB/s = 16 ms; a step of 83 + 0.17748 + 16.24032 ms
//   auto        none (100 ms) does not fit in backward, fp16 (50 ms) does: fp16
TEST(WhatIf, CompressionIsPricedByItsBytesAndItsCompute) {
  const auto table = goldenTable();
  const auto mix = table.parseMix("fast@wide,slow@narrow");
  auto s = goldenSettings();
  s.compression = "fp16";
  const auto fp16 = hddp::predictMix(mix, goldenProfile(), s, table);
  EXPECT_NEAR(fp16.allreduceSeconds, 0.050, 1e-9);
  EXPECT_NEAR(fp16.exposedAllreduceSeconds, 0.0101541120, 1e-9);
  EXPECT_NEAR(fp16.stepSeconds, 0.0931541120, 1e-9);
  EXPECT_EQ(fp16.compression.spec.name(), "fp16");
  EXPECT_EQ(fp16.compression.messages, 5) << "buckets of 1 MiB, 3 x 25 MiB and the rest";
  EXPECT_TRUE(hasAdvice(fp16,
                        "with fp16 compression the allreduce carries 50 MB per step "
                        "instead of 100 MB"))
      << adviceText(fp16);

  s.compression = "powersgd:4";
  const auto psgd = hddp::predictMix(mix, goldenWithShapes(), s, table);
  EXPECT_NEAR(psgd.compression.wireBytes, 480000.0, 1e-6);
  EXPECT_NEAR(psgd.allreduceSeconds, 0.00048, 1e-12);
  EXPECT_NEAR(psgd.compression.computeSeconds, 0.00024032 + 0.016, 1e-12);
  EXPECT_NEAR(psgd.stepSeconds, 0.083 + 0.48e-3 * (0.20308224 + 1.0 / 6) + 0.01624032, 1e-9);

  s.compression = "auto";
  const auto chosen = hddp::predictMix(mix, goldenWithShapes(), s, table);
  EXPECT_EQ(chosen.compression.spec.name(), "fp16");
  ASSERT_EQ(chosen.compressionCandidates.size(), 4u);
  EXPECT_NEAR(chosen.stepSeconds, fp16.stepSeconds, 1e-12);
  EXPECT_TRUE(hasAdvice(chosen, "--compress auto would choose fp16")) << adviceText(chosen);

  // PowerSGD without the shapes cannot be priced, and the error says how to get them.
  s.compression = "powersgd";
  try {
    hddp::predictMix(mix, goldenProfile(), s, table);
    FAIL() << "no error";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("profile the model again"), std::string::npos) << e.what();
  }
  s.compression = "lz4";
  EXPECT_THROW(hddp::predictMix(mix, goldenProfile(), s, table), hddp::ConfigError);
}

TEST(WhatIf, AProfileKeepsItsGradientShapes) {
  const auto p = goldenWithShapes();
  const auto q = hddp::ModelProfile::fromJson(p.toJson(), "p.json");
  EXPECT_EQ(q.gradientShapes, p.gradientShapes);
  std::string bad = p.toJson();
  bad.replace(bad.find("5000"), 4, "-500");
  EXPECT_THROW(hddp::ModelProfile::fromJson(bad, "p.json"), hddp::ConfigError);
  // A profile without them (saved before they were recorded) still reads.
  EXPECT_TRUE(
      hddp::ModelProfile::fromJson(goldenProfile().toJson(), "p.json").gradientShapes.empty());
}

namespace {

// An 8 GiB card beside a 24 GiB card, for ZeRO; and a model of 2 GiB of fp32 weights
// whose Adam state (2 copies, 4 GiB) the small card cannot hold beside its weights and
// gradients.
hddp::DeviceTable zeroTable() {
  return hddp::DeviceTable::parse(R"({
    "devices": {
      "small": {"name": "Small", "fp32_tflops": 10, "fp16_tflops": 0, "bf16_tflops": 0,
                "memory_gib": 8, "memory_GBps": 100, "source": "test"},
      "large": {"name": "Large", "fp32_tflops": 30, "fp16_tflops": 0, "bf16_tflops": 0,
                "memory_gib": 24, "memory_GBps": 300, "source": "test"}},
    "links": {"wide": {"name": "Wide", "GBps": 10, "source": "test"}}})",
                                  "zero.json");
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

hddp::ModelProfile zeroProfile() {
  auto p = goldenProfile();
  p.model = "big";
  p.parameterBytes = 2.0 * kGiB;
  p.activationBytesPerSample = 64.0 * (1 << 20);
  return p;
}

hddp::WhatIfSettings adamSettings(int zero, const std::string& shardBy) {
  auto s = goldenSettings();
  s.globalBatch = 64;
  s.optimizerStateCopies = 2;  // Adam
  s.zero = zero;
  s.shardBy = shardBy;
  return s;
}

}  // namespace

// Without ZeRO every device holds the weights, a gradient for each and all the state:
// the golden case's parts are 1e8 B each (momentum SGD, 1 copy) and 32 MiB a sample. A
// single device under ZeRO holds all of it too, and its prediction is the plain one.
TEST(WhatIfZero, WithoutZeroEveryDeviceHoldsAllOfTheModel) {
  const auto table = goldenTable();
  const auto r = hddp::predictMix(table.parseMix("fast@wide,slow@narrow"), goldenProfile(),
                                  goldenSettings(), table);
  ASSERT_EQ(r.devices.size(), 2u);
  for (const auto& d : r.devices) {
    EXPECT_EQ(d.parameterBytes, 1e8);
    EXPECT_EQ(d.gradientBytes, 1e8);
    EXPECT_EQ(d.stateBytes, 1e8);
    EXPECT_EQ(d.activationBytes, 32.0 * (1 << 20) * static_cast<double>(d.local));
    EXPECT_EQ(d.shareOfState, 1.0);
    EXPECT_DOUBLE_EQ(d.memoryBytes, 3e8 + d.activationBytes);
  }
  for (int zero : {1, 2}) {
    auto s = goldenSettings();
    s.globalBatch = 32;
    s.zero = zero;
    const auto alone = hddp::predictMix(table.parseMix("slow@wide"), goldenProfile(), s, table);
    auto plainSettings = goldenSettings();
    plainSettings.globalBatch = 32;
    const auto plain =
        hddp::predictMix(table.parseMix("slow@wide"), goldenProfile(), plainSettings, table);
    EXPECT_EQ(alone.devices[0].shareOfState, 1.0) << zero;
    EXPECT_EQ(alone.devices[0].memoryCap, plain.devices[0].memoryCap) << zero;
    EXPECT_EQ(alone.devices[0].memoryBytes, plain.devices[0].memoryBytes) << zero;
    EXPECT_EQ(alone.stepSeconds, plain.stepSeconds) << zero;
  }
}

// By hand (GiB; budget = total x 0.9 - 0.5 of context; 64 MiB = 1/16 GiB a sample):
//   plain    fixed 2 + 2 + 4 = 8: the small card's budget 6.7 cannot hold it (cap 0), the
//            large one's 21.1 holds (21.1 - 8) x 16 = 209.6 -> 209 samples: a global
//            batch of 230 is a ConfigError
//   ZeRO-2   by memory, weights = free after the weights: small 8 - 0.5 - 2 = 5.5, large
//            21.5; shares 5.5/27 and 21.5/27 of the 6 GiB of gradients and state:
//            small fixed 2 + 6 x 5.5/27 = 3.2222, (6.7 - 3.2222) x 16 = 55.6 -> 55;
//            large 2 + 6 x 21.5/27 = 6.7778, (21.1 - 6.7778) x 16 = 229.2 -> 229
//   ZeRO-2   equal: 2 + 3 = 5 each: small (6.7 - 5) x 16 = 27.2 -> 27, large 257.6 -> 257
//   ZeRO-1   by memory, weights less the gradients too: 3.5 and 19.5 of 23, of the 4 of
//            state: small 4 + 4 x 3.5/23 = 4.6087, (6.7 - 4.6087) x 16 = 33.5 -> 33
TEST(WhatIfZero, AdamThatASmallCardCannotHoldFitsItsShard) {
  const auto table = zeroTable();
  const auto mix = table.parseMix("small@wide,large@wide");
  const auto p = zeroProfile();

  const auto plain = hddp::predictMix(mix, p, adamSettings(0, "memory"), table);
  EXPECT_EQ(plain.devices[0].memoryCap, 0);
  EXPECT_EQ(plain.devices[1].memoryCap, 209);
  EXPECT_EQ(plain.plan.local, (std::vector<int64_t>{0, 64}));
  EXPECT_TRUE(hasAdvice(plain, "the small (8 GiB) cannot hold the model in fp32: 8.00 GiB"))
      << adviceText(plain);

  const auto zero2 = hddp::predictMix(mix, p, adamSettings(2, "memory"), table);
  const auto& small = zero2.devices[0];
  const auto& large = zero2.devices[1];
  EXPECT_NEAR(small.shareOfState, 5.5 / 27, 1e-12);
  EXPECT_NEAR(large.shareOfState, 21.5 / 27, 1e-12);
  EXPECT_EQ(small.parameterBytes, 2 * kGiB) << "the weights stay whole";
  EXPECT_NEAR(small.gradientBytes, 2 * kGiB * 5.5 / 27, 1);
  EXPECT_NEAR(small.stateBytes, 4 * kGiB * 5.5 / 27, 1);
  EXPECT_NEAR(large.stateBytes, 4 * kGiB * 21.5 / 27, 1);
  EXPECT_LT(small.stateBytes, large.stateBytes);
  EXPECT_NEAR(small.stateBytes + large.stateBytes, 4 * kGiB, 1) << "the state is held once";
  EXPECT_EQ(small.memoryCap, 55);
  EXPECT_EQ(large.memoryCap, 229);
  // A batch the large card alone cannot hold (209): refused without ZeRO, trained with
  // the small card's share under ZeRO-2.
  auto bigBatch = adamSettings(0, "memory");
  bigBatch.globalBatch = 230;
  EXPECT_THROW(hddp::predictMix(mix, p, bigBatch, table), hddp::ConfigError);
  bigBatch.zero = 2;
  EXPECT_GT(hddp::predictMix(mix, p, bigBatch, table).plan.local[0], 0);
  EXPECT_DOUBLE_EQ(small.memoryBytes, small.parameterBytes + small.gradientBytes +
                                          small.stateBytes + small.activationBytes);
  EXPECT_FALSE(hasAdvice(zero2, "cannot hold the model")) << adviceText(zero2);
  EXPECT_TRUE(hasAdvice(zero2,
                        "ZeRO-2 shards the optimizer state and the gradients by memory: the "
                        "small 20% (1.22 GiB), the large 80% (4.78 GiB); memory caps 55, 229 "
                        "samples, against 0, 209 without ZeRO"))
      << adviceText(zero2);

  const auto equal = hddp::predictMix(mix, p, adamSettings(2, "equal"), table);
  for (const auto& d : equal.devices) {
    EXPECT_EQ(d.shareOfState, 0.5);
    EXPECT_EQ(d.stateBytes, 2 * kGiB) << "half of the 4 GiB of Adam state";
    EXPECT_EQ(d.gradientBytes, 1 * kGiB);
  }
  EXPECT_EQ(equal.devices[0].memoryCap, 27);
  EXPECT_EQ(equal.devices[1].memoryCap, 257);

  const auto zero1 = hddp::predictMix(mix, p, adamSettings(1, "memory"), table);
  EXPECT_NEAR(zero1.devices[0].shareOfState, 3.5 / 23, 1e-12);
  EXPECT_EQ(zero1.devices[0].gradientBytes, 2 * kGiB) << "ZeRO-1 keeps every gradient";
  EXPECT_NEAR(zero1.devices[0].stateBytes, 4 * kGiB * 3.5 / 23, 1);
  EXPECT_EQ(zero1.devices[0].memoryCap, 33);
}

// A device's cap follows its shard. By memory, the shards take the same fraction of each
// card's free memory after the weights (6 GiB of 27 here), so neither card is squeezed
// more than the other; given ratios on two equal cards, the larger shard leaves room
// for fewer samples: 24 GiB cards, 1:3 of 6 GiB, budgets 21.1 - 2 - 1.5 = 17.6 GiB ->
// 281 samples and 21.1 - 2 - 4.5 = 14.6 GiB -> 233 (48 fewer for the 3 GiB more).
TEST(WhatIfZero, TheLargerShardLeavesRoomForFewerSamples) {
  const auto table = zeroTable();
  const auto p = zeroProfile();
  const auto byMemory = hddp::predictMix(table.parseMix("small@wide,large@wide"), p,
                                         adamSettings(2, "memory"), table);
  for (const auto& d : byMemory.devices) {
    const double freeAfterWeights = d.entry.device.memoryGiB * kGiB - 512.0 * (1 << 20) - 2 * kGiB;
    EXPECT_NEAR((d.gradientBytes + d.stateBytes) / freeAfterWeights, 6.0 / 27, 1e-12)
        << d.entry.device.key;
    // The Trainer's cap rule on its own fixed bytes.
    const double budget = d.entry.device.memoryGiB * kGiB * 0.9 - 512.0 * (1 << 20);
    EXPECT_EQ(d.memoryCap, static_cast<int64_t>(std::floor(
                               (budget - d.parameterBytes - d.gradientBytes - d.stateBytes) /
                               p.activationBytesPerSample)))
        << d.entry.device.key;
  }
  const auto ratios =
      hddp::predictMix(table.parseMix("large@wide,large@wide"), p, adamSettings(2, "1:3"), table);
  EXPECT_EQ(ratios.devices[0].shareOfState, 0.25);
  EXPECT_EQ(ratios.devices[1].shareOfState, 0.75);
  EXPECT_EQ(ratios.devices[0].memoryCap, 281);
  EXPECT_EQ(ratios.devices[1].memoryCap, 233);
  // Without ZeRO the two equal cards hold the same.
  const auto plain =
      hddp::predictMix(table.parseMix("large@wide,large@wide"), p, adamSettings(0, "1:3"), table);
  EXPECT_EQ(plain.devices[0].memoryCap, plain.devices[1].memoryCap);
}

// The shard text is the trainers' --shard-by: hddp::parseShardBy (the ddp layer) and
// what-if accept and refuse the same texts; a bad one is named; ratios must be one per
// device of the mix; --zero is 0, 1 or 2; and ZeRO with compression is refused as the
// Trainer refuses it (auto prices none, as the Trainer turns it off).
TEST(WhatIfZero, BadShardsZeroAndCompressionAreConfigErrors) {
  const auto table = zeroTable();
  const auto mix = table.parseMix("small@wide,large@wide");
  const auto p = zeroProfile();
  for (const char* text : {"memory", "equal", "1:3", "0:2.5", "1:3:", "", "1:", ":1", "1:x", "0:0",
                           "-1:2", "Memory", "1:inf", "nan:1"}) {
    bool ddpAccepts = true;
    try {
      hddp::parseShardBy(text);
    } catch (const hddp::ConfigError&) {
      ddpAccepts = false;
    }
    bool whatIfAccepts = true;
    try {
      hddp::stateShares(mix, p, adamSettings(0, text));
    } catch (const hddp::ConfigError&) {
      whatIfAccepts = false;
    }
    EXPECT_EQ(whatIfAccepts, ddpAccepts) << "'" << text << "'";
  }
  auto message = [&](const hddp::WhatIfSettings& s) {
    try {
      hddp::predictMix(mix, p, s, table);
    } catch (const hddp::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(adamSettings(2, "1:x")).find("--shard-by '1:x': 'x' is not a number >= 0"),
            std::string::npos)
      << message(adamSettings(2, "1:x"));
  EXPECT_NE(message(adamSettings(2, "mem")).find("--shard-by 'mem'"), std::string::npos);
  EXPECT_NE(message(adamSettings(2, "0:0")).find("not all 0"), std::string::npos);
  EXPECT_NE(message(adamSettings(2, "1:2:3"))
                .find("--shard-by 1:2:3 gives 3 ratios for 2 devices "
                      "in the mix; give one per device"),
            std::string::npos)
      << message(adamSettings(2, "1:2:3"));
  EXPECT_NE(message(adamSettings(1, "2")).find("gives 1 ratios for 2 devices"), std::string::npos);
  EXPECT_NE(message(adamSettings(3, "memory")).find("--zero is 3; give 0"), std::string::npos);
  EXPECT_NE(message(adamSettings(-1, "memory")).find("--zero is -1"), std::string::npos);
  auto fp16 = adamSettings(2, "memory");
  fp16.compression = "fp16";
  EXPECT_NE(message(fp16).find("cannot be combined with gradient compression (--compress fp16)"),
            std::string::npos)
      << message(fp16);
  fp16.zero = 0;
  EXPECT_EQ(message(fp16), "no error") << "compression without ZeRO is priced";
  auto automatic = adamSettings(1, "memory");
  automatic.compression = "auto";
  const auto r = hddp::predictMix(mix, p, automatic, table);
  EXPECT_EQ(r.compression.spec.kind, hddp::CompressionSpec::Kind::None);
  EXPECT_TRUE(r.compressionCandidates.empty());
  EXPECT_TRUE(hasAdvice(r, "--compress auto chooses none, as the Trainer does")) << adviceText(r);
  // No device has room for a shard: the 8 GiB cards' 7.5 GiB left go to 8 GiB of weights.
  auto huge = p;
  huge.parameterBytes = 8 * kGiB;
  try {
    hddp::stateShares(table.parseMix("small@wide,small@wide"), huge, adamSettings(2, "memory"));
    FAIL() << "no error";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no device of the mix has memory left for a ZeRO-2 "
                                         "shard after 8.00 GiB of weights of big"),
              std::string::npos)
        << e.what();
  }
}

// Without a device, the rest of the mix shares the shards between fewer cards: the large
// card alone holds all 6 GiB of gradients and state (cap 209, not its shard's 229), so
// alone it trains B = 220 in two micro-batches, and the advice prices the small card's
// gain against that.
TEST(WhatIfZero, TheRestOfTheMixHoldsTheWholeShard) {
  const auto table = zeroTable();
  const auto p = zeroProfile();
  auto s = adamSettings(2, "memory");
  s.globalBatch = 220;
  const auto r = hddp::predictMix(table.parseMix("small@wide,large@wide"), p, s, table);
  ASSERT_EQ(r.devices[1].memoryCap, 229);
  const auto& large = r.devices[1].cost;
  const double alone = 220.0 / (2 * large.fixedSeconds + 220 * large.perSampleSeconds());
  EXPECT_EQ(r.fastest, 1);
  EXPECT_NEAR(r.fastestAloneSamplesPerSecond, alone, 1e-9);
  // The small card's fixed 150 ms and the 2 GiB allreduce cost more than it gives.
  ASSERT_LT(r.samplesPerSecond, alone);
  char slows[80];
  std::snprintf(slows, sizeof(slows), "the small on wide slows the rest of the mix by %.0f%%",
                100.0 * (1.0 - r.samplesPerSecond / alone));
  EXPECT_TRUE(hasAdvice(r, slows)) << slows << "\n" << adviceText(r);
  EXPECT_TRUE(hasAdvice(r,
                        "without the large on wide the other devices' memory cannot hold "
                        "the global batch"))
      << adviceText(r);
}
