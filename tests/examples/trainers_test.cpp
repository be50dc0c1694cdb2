// The example trainers end to end, as a user runs them from the shell: 1 and 2 ranks
// (through hddp-run), bf16 autocast and activation checkpointing, tiny data, a few
// steps; the training loss must go down and the evaluation must be reported. Also the
// errors a user gets for bad flags.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#if __has_include(<stb/stb_image_write.h>)
#include <stb/stb_image_write.h>
#else
#include <stb_image_write.h>
#endif

#include "example_common.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/topology/topology.h"
#include "hddp/train/state_file.h"
#include "support/emulated_device.h"
#include "support/ranks.h"

namespace fs = std::filesystem;

namespace {

// Not std::filesystem::remove_all: in a process linked with the torch wheel's
// libtorch.so that call resolves into libtorch's copy and crashes (a null call).
void removeTree(const std::string& dir) {
  ASSERT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0) << dir;
}

struct RunResult {
  int status = -1;
  std::string output;
  std::vector<nlohmann::json> records;  // rank 0's metrics lines
};

// Runs `program args` on `ranks` ranks (hddp-run for 2+) with metrics into a temp dir.
// The ranks run on the CPU. `env` comes before the command: by default bf16 stays bf16
// on a CPU without native bf16 (HDDP_BF16_FALLBACK=0), so that the bf16 runs test bf16
// on every machine.
RunResult runTrainer(const std::string& program, const std::string& args, int ranks = 1,
                     const std::string& env = "HDDP_BF16_FALLBACK=0") {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string metrics = dir + "/metrics.jsonl";
  const std::string log = dir + "/out.log";
  std::string cmd = "HDDP_DEVICE=cpu " + env + " ";  // CPU ranks on a GPU machine too
  if (ranks > 1) {
    cmd +=
        hddp::testing::toolsDir() + "/hddp-run --nproc-per-node " + std::to_string(ranks) + " -- ";
  }
  cmd += program + " " + args + " --threads 1 --progress lines --metrics " + metrics + " > " + log +
         " 2>&1";
  RunResult r;
  const int raw = std::system(cmd.c_str());
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  r.output = text.str();
  std::ifstream lines(metrics);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) {
      r.records.push_back(nlohmann::json::parse(line));
    }
  }
  removeTree(dir);
  return r;
}

std::vector<nlohmann::json> ofKind(const RunResult& r, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& rec : r.records) {
    if (rec.value("kind", "") == kind) {
      out.push_back(rec);
    }
  }
  return out;
}

// Epoch records' mean training loss decreases from the first epoch to the last.
void expectLearns(const RunResult& r, int epochs) {
  ASSERT_EQ(r.status, 0) << r.output;
  const auto epochRecords = ofKind(r, "epoch");
  ASSERT_EQ(static_cast<int>(epochRecords.size()), epochs) << r.output;
  const double first = epochRecords.front()["train_loss"].get<double>();
  const double last = epochRecords.back()["train_loss"].get<double>();
  EXPECT_LT(last, 0.9 * first) << r.output;
  const auto summary = ofKind(r, "summary");
  ASSERT_EQ(summary.size(), 1u) << r.output;
}

const std::string kResnet = HDDP_TEST_TRAIN_RESNET;
const std::string kUnet = HDDP_TEST_TRAIN_UNET;
const std::string kTinyResnet =
    "--model resnet20 --dataset synthetic --image-size 16 --limit-train 192 --limit-test 96 "
    "--global-batch 32 --epochs 3 --lr 0.05 --workers 1";
const std::string kTinyUnet =
    "--image-size 32 --depth 2 --base-width 8 --samples 96 --test-samples 32 --global-batch 16 "
    "--epochs 3 --workers 1";

TEST(ExampleTrainers, ResnetOneRankLearnsAndReportsAccuracy) {
  auto r = runTrainer(kResnet, kTinyResnet);
  expectLearns(r, 3);
  const auto summary = ofKind(r, "summary").at(0);
  ASSERT_TRUE(summary.contains("test_acc")) << r.output;
  EXPECT_GT(summary["test_acc"].get<double>(), 0.2) << r.output;  // 10 classes: chance 0.1
  EXPECT_NE(r.output.find("test accuracy"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("test_acc"), std::string::npos) << "per-epoch line\n" << r.output;
  // 192 samples in steps of 32: the progress counts 6 of 6, never past its end (6/5).
  EXPECT_NE(r.output.find("step 6/6 "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 6/5 "), std::string::npos) << r.output;
}

TEST(ExampleTrainers, ResnetTwoRanksBf16CheckpointedLearns) {
  auto r = runTrainer(kResnet, kTinyResnet + " --amp bf16 --checkpoint-activations", 2);
  expectLearns(r, 3);
  EXPECT_TRUE(ofKind(r, "summary").at(0).contains("test_acc")) << r.output;
}

TEST(ExampleTrainers, ResnetMaxStepsEndsWithAnEvaluation) {
  auto r = runTrainer(kResnet, kTinyResnet + " --max-steps 4", 2);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto evals = ofKind(r, "evaluation");
  ASSERT_EQ(evals.size(), 1u) << r.output;
  EXPECT_EQ(evals[0]["step"].get<int64_t>(), 4);
  EXPECT_TRUE(ofKind(r, "summary").at(0).contains("test_acc")) << r.output;
}

// BatchNorm's running statistics come from the ranks that trained: with one rank so
// slow that it gets no samples, the evaluation (eval-mode BatchNorm) is the same
// whichever rank is the slow one. Rank 0's broadcast gave everyone the zero-share rank's
// initial statistics when rank 0 was slow (test accuracy at chance, loss in the
// thousands), and the right ones when rank 1 was.
TEST(ExampleTrainers, EvaluationDoesNotDependOnWhichRankIsSlow) {
  const std::string args =
      "--model resnet20 --dataset synthetic --image-size 16 --limit-train 384 --limit-test 192 "
      "--global-batch 32 --epochs 2 --lr 0.05 --workers 0";
  std::vector<nlohmann::json> summaries;
  for (const char* slow : {"0:300", "1:300"}) {
    auto r = runTrainer(kResnet, args + " --emulate-slowdown " + slow, 2);
    ASSERT_EQ(r.status, 0) << r.output;
    summaries.push_back(ofKind(r, "summary").at(0));
    ASSERT_TRUE(summaries.back().contains("test_acc")) << r.output;
  }
  const double acc0 = summaries[0]["test_acc"].get<double>();
  const double acc1 = summaries[1]["test_acc"].get<double>();
  const double loss0 = summaries[0]["test_loss"].get<double>();
  const double loss1 = summaries[1]["test_loss"].get<double>();
  EXPECT_NEAR(acc0, acc1, 0.011) << summaries[0] << "\n" << summaries[1];
  EXPECT_NEAR(loss0, loss1, 0.05 * std::max(loss0, loss1)) << summaries[0] << "\n" << summaries[1];
  EXPECT_GT(acc0, 0.2) << summaries[0];
}

// Under hddp-run's elastic mode, --save-every without --save-dir commits to the job's
// folder, as hddp-run says ("commits in DIR unless the program saves elsewhere").
TEST(ExampleTrainers, SaveEveryUnderAnElasticJobCommitsToTheJobFolder) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = hddp::testing::runCommand("HDDP_DEVICE=cpu " + hddp::testing::toolsDir() +
                                     "/hddp-run --nproc-per-node 1:2 --job-dir " + dir +
                                     "/job -- " + kResnet + " " + kTinyResnet +
                                     " --threads 1 --progress off --max-steps 4 --save-every 2");
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/job/state-00000004.hddp")) << r.output;
  // Resumed, the closing line says the job's step and, apart, what this run trained.
  auto again = hddp::testing::runCommand("HDDP_DEVICE=cpu " + kResnet + " " + kTinyResnet +
                                         " --threads 1 --progress lines --max-steps 6 --resume " +
                                         dir + "/job");
  ASSERT_EQ(again.exitCode, 0) << again.output;
  EXPECT_NE(again.output.find("done: step 6 of the job; this run trained 2 steps"),
            std::string::npos)
      << again.output;
  removeTree(dir);
}

// The model's tensors in a state file the trainer wrote ("model.<name>"), on the CPU.
std::map<std::string, at::Tensor> modelInStateFile(const std::string& path) {
  const std::string payload = hddp::readStateFile(path);
  torch::serialize::InputArchive archive;
  archive.load_from(payload.data(), payload.size(), c10::Device(c10::kCPU));
  std::map<std::string, at::Tensor> model;
  for (const auto& key : archive.keys()) {
    if (key.rfind("model.", 0) == 0) {
      at::Tensor t;
      archive.read(key, t);
      model[key] = t;
    }
  }
  return model;
}

// A rank on an emulated accelerator next to a CPU rank, as `hddp-run --devices
// cuda:0,cpu` runs a GPU next to a CPU: the trainer installs hddp::emu because a device
// names it, says which device each rank is on, and trains to the parameters of the
// same job on two CPU ranks (a fixed equal split, so both runs compute the same sums).
TEST(ExampleTrainers, AnEmulatedDeviceRankNextToACpuRankTrainsAsTwoCpuRanks_Emu) {
  hddp::testing::emulatedDevice(0);  // the state file names emu:0 (the optimizer's state)
  std::vector<std::map<std::string, at::Tensor>> models;
  for (const char* devices : {"cpu,cpu", "emu:0,cpu"}) {
    const std::string dir = hddp::testing::makeTempDir();
    auto r = hddp::testing::runCommand(
        hddp::testing::toolsDir() + "/hddp-run --nproc-per-node 2 --devices " + devices + " -- " +
        kResnet +
        " --model resnet20 --dataset synthetic --image-size 16 --limit-train 640 --limit-test 64 "
        "--global-batch 32 --max-steps 20 --workers 1 --threads 1 --no-balance --progress off "
        "--save-dir " +
        dir + " --save-every 20");
    ASSERT_EQ(r.exitCode, 0) << r.output;
    if (std::string(devices) == "emu:0,cpu") {
      EXPECT_NE(r.output.find("rank 0 trains on emu:0 (gloo communicates from cpu)"),
                std::string::npos)
          << r.output;
      EXPECT_NE(r.output.find("rank 1 trains on cpu"), std::string::npos) << r.output;
      // Only the rank on emu installs it (a CUDA rank beside it keeps CUDA's pinning).
      size_t installs = 0;
      for (size_t at = r.output.find("hddp::emu installed"); at != std::string::npos;
           at = r.output.find("hddp::emu installed", at + 1)) {
        ++installs;
      }
      EXPECT_EQ(installs, 1u) << r.output;
    }
    models.push_back(modelInStateFile(dir + "/state-00000020.hddp"));
    removeTree(dir);
  }
  ASSERT_EQ(models[0].size(), models[1].size());
  ASSERT_GT(models[0].size(), 10u);
  for (const auto& [name, cpu] : models[0]) {
    const at::Tensor& emu = models[1].at(name);
    EXPECT_TRUE(torch::allclose(cpu, emu, 1e-4, 1e-5))
        << name << ": largest difference " << (cpu - emu).abs().max().item<double>();
  }
}

// U-Net on two unlike emulated cards (emu:1 computes 4x slower, as a slower GPU would,
// through emu's own slowdown rather than hddp's timing emulation): it learns, rank 0's
// memory is read from its device's allocator, and the planner gives the slow card less.
TEST(ExampleTrainers, UnetOnTwoUnlikeEmulatedCardsLearnsAndTheSlowOneGetsLess_Emu) {
  auto r = runTrainer(kUnet, kTinyUnet, 2, "HDDP_DEVICE=emu:0,emu:1 HDDP_EMU_SLOWDOWN=1:4");
  expectLearns(r, 3);
  EXPECT_NE(r.output.find("on emu:0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on emu:1"), std::string::npos) << r.output;
  // Each rank told emu its own device: an allocation on the other rank's, or a missing
  // record_stream, would be reported (once, in CI, rank 1 got a tensor on emu:0).
  EXPECT_EQ(r.output.find("hddp::emu:"), std::string::npos) << r.output;
  const auto steps = ofKind(r, "step");
  ASSERT_FALSE(steps.empty());
  const auto& last = steps.back();
  ASSERT_TRUE(last.contains("memory")) << last;
  EXPECT_GT(last["memory"]["peak_allocated_bytes"].get<int64_t>(), 0) << last;
  const auto plan = last["plan"].get<std::vector<int64_t>>();
  ASSERT_EQ(plan.size(), 2u) << last;
  EXPECT_GT(plan[0], plan[1]) << "emu:1 is 4x slower; the split should favour emu:0: " << last;
}

TEST(ExampleTrainers, ResnetOnFashionMnistWhenInstalled) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist not installed";
  }
  auto r = runTrainer(
      kResnet, "--limit-train 512 --limit-test 256 --global-batch 64 --epochs 2 --lr 0.05", 2);
  expectLearns(r, 2);
  EXPECT_NE(r.output.find("Fashion-MNIST"), std::string::npos) << r.output;
}

TEST(ExampleTrainers, ResnetOnAnImageFolderWithHeldOutSplit) {
  // Two classes: bright top half vs bright bottom half, 24 PNGs each.
  const std::string dir = hddp::testing::makeTempDir();
  std::mt19937 rng(3);
  for (int c = 0; c < 2; ++c) {
    const std::string sub = dir + "/" + (c ? "bottom" : "top");
    fs::create_directories(sub);
    for (int i = 0; i < 24; ++i) {
      std::vector<unsigned char> px(16 * 16);
      for (int y = 0; y < 16; ++y) {
        for (int x = 0; x < 16; ++x) {
          const bool lit = (y < 8) != (c == 1);
          px[static_cast<size_t>(y * 16 + x)] =
              static_cast<unsigned char>((lit ? 180 : 40) + static_cast<int>(rng() % 40));
        }
      }
      ASSERT_TRUE(stbi_write_png((sub + "/" + std::to_string(i) + ".png").c_str(), 16, 16, 1,
                                 px.data(), 16));
    }
  }
  auto r =
      runTrainer(kResnet, "--dataset folder --data " + dir +
                              " --channels 1 --image-size 16 --val-fraction 0.25 --global-batch 12 "
                              "--epochs 3 --lr 0.05 --workers 1");
  removeTree(dir);
  expectLearns(r, 3);
  EXPECT_NE(r.output.find("(36 of them)"), std::string::npos) << r.output;
}

TEST(ExampleTrainers, UnetOneRankLearnsAndReportsIoU) {
  auto r = runTrainer(kUnet, kTinyUnet);
  expectLearns(r, 3);
  const auto summary = ofKind(r, "summary").at(0);
  for (const char* key : {"mean_iou", "dice", "pixel_acc", "test_loss"}) {
    EXPECT_TRUE(summary.contains(key)) << key << "\n" << r.output;
  }
  EXPECT_NE(r.output.find("mean IoU"), std::string::npos) << r.output;
  // Per class Dice = 2 IoU / (1 + IoU) >= IoU; all are fractions.
  const double iou = summary["mean_iou"].get<double>();
  const double dice = summary["dice"].get<double>();
  const double acc = summary["pixel_acc"].get<double>();
  EXPECT_GE(dice, iou);
  EXPECT_GE(iou, 0.0);
  EXPECT_LE(dice, 1.0);
  EXPECT_GT(acc, 0.0);
  EXPECT_LE(acc, 1.0);
}

TEST(ExampleTrainers, UnetTwoRanksBf16CheckpointedLearns) {
  auto r = runTrainer(kUnet, kTinyUnet + " --amp bf16 --checkpoint-activations", 2);
  expectLearns(r, 3);
}

TEST(ExampleTrainers, BadFlagsSayWhatIsWrong) {
  auto r = runTrainer(kResnet, "--dataset cifar10");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--data DIR"), std::string::npos) << r.output;
  r = runTrainer(kUnet, "--image-size 30 --depth 2");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("not a multiple of 2^depth"), std::string::npos) << r.output;
  r = runTrainer(kResnet, "--model resnet21");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--model"), std::string::npos) << r.output;
  r = runTrainer(kResnet, "--dataset mnist --data /nonexistent-hddp-dir");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("/nonexistent-hddp-dir"), std::string::npos) << r.output;
  r = runTrainer(kResnet, "--amp fp16 --dataset synthetic");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("bf16"), std::string::npos) << r.output;
  r = runTrainer(kResnet, "--dataset synthetic --device gpu");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--device: 'gpu' is not a device; use cpu, cuda or cuda:N"),
            std::string::npos)
      << r.output;
  r = runTrainer(kResnet, "--dataset synthetic --device cuda:9");  // no machine has nine
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("is given cuda:9 by --device"), std::string::npos) << r.output;
}

// bf16 on a CPU without native bf16 trains in float32 and says so (emulated bf16 is
// ~11x slower there); --amp auto picks bf16 only where it is native. The expectation
// follows this machine's /proc/cpuinfo.
TEST(ExampleTrainers, Bf16FallsBackToFloat32WhereTheCpuLacksIt) {
  const auto bf16 = hddp::bf16Support(c10::Device(c10::kCPU));
  auto r = runTrainer(kResnet, kTinyResnet + " --max-steps 2 --amp bf16", 1, "HDDP_LOG_LEVEL=info");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("so this rank trains in float32") != std::string::npos, !bf16.native)
      << r.output;
  EXPECT_EQ(r.output.find("bf16 natively (" + bf16.why + ")") != std::string::npos, bf16.native)
      << r.output;
  r = runTrainer(kResnet, kTinyResnet + " --max-steps 2 --amp auto", 1, "HDDP_LOG_LEVEL=info");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find(std::string("--amp auto on cpu: ") + (bf16.native ? "bf16" : "float32") +
                          " (" + bf16.why + ")"),
            std::string::npos)
      << r.output;
  r = runTrainer(kResnet, kTinyResnet + " --max-steps 2 --amp bf16", 1, "HDDP_BF16_FALLBACK=0");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("so this rank trains in float32"), std::string::npos) << r.output;
}

// Range checks used to print their bound as a 300-digit number.
TEST(ExampleTrainers, OutOfRangeFlagsPrintReadableBounds) {
  for (const std::string flag : {"--lr -1", "--global-batch 0", "--weight-decay -0.5"}) {
    auto r = runTrainer(kResnet, flag + " --dataset synthetic");
    EXPECT_NE(r.status, 0) << flag << ": " << r.output;
    EXPECT_NE(r.output.find("must be >"), std::string::npos) << flag << ": " << r.output;
    EXPECT_LT(r.output.size(), 400u) << flag << ": " << r.output;
    EXPECT_EQ(r.output.find("0000000000"), std::string::npos) << flag << ": " << r.output;
  }
}

// Per-rank lists are checked item by item against the job's ranks.
TEST(ExampleTrainers, PerRankListsAreCheckedAgainstTheRanks) {
  auto r = runTrainer(kResnet, "--dataset synthetic --emulate-slowdown 7:abc");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--emulate-slowdown"), std::string::npos) << r.output;
  r = runTrainer(kResnet, "--dataset synthetic --max-local-batch 0:0");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("cap 0"), std::string::npos) << r.output;
}

TEST(ExampleCommon, LearningRateSchedules) {
  hddp::examples::CommonFlags f;
  f.lr = 0.4;
  f.schedule = "cosine";
  using hddp::examples::scheduledLearningRate;
  EXPECT_DOUBLE_EQ(scheduledLearningRate(f, 0, 100, 10), 0.04);  // warm-up 1/10
  EXPECT_DOUBLE_EQ(scheduledLearningRate(f, 9, 100, 10), 0.4);
  EXPECT_DOUBLE_EQ(scheduledLearningRate(f, 10, 100, 10), 0.4);    // cosine starts at the peak
  EXPECT_NEAR(scheduledLearningRate(f, 55, 100, 10), 0.2, 1e-12);  // half way
  EXPECT_NEAR(scheduledLearningRate(f, 100, 100, 10), 0.0, 1e-12);
  f.schedule = "step";
  EXPECT_DOUBLE_EQ(scheduledLearningRate(f, 49, 100, 0), 0.4);
  EXPECT_NEAR(scheduledLearningRate(f, 50, 100, 0), 0.04, 1e-12);
  EXPECT_NEAR(scheduledLearningRate(f, 80, 100, 0), 0.004, 1e-12);
  f.schedule = "constant";
  EXPECT_DOUBLE_EQ(scheduledLearningRate(f, 99, 100, 0), 0.4);
}

TEST(ExampleCommon, RandomSubsetsAreDisjointSeededAndChecked) {
  auto base = std::make_shared<hddp::SyntheticClassificationDataset>(50, 1, 4, 2, 1);
  auto held = hddp::examples::randomSubset(base, 10, 3, 0);
  auto rest = hddp::examples::randomSubset(base, 40, 3, 10);
  EXPECT_EQ(held->size(), 10);
  EXPECT_EQ(rest->size(), 40);
  // Same seed: the two parts of one permutation, so together every sample once.
  std::set<std::vector<float>> seen;
  hddp::SampleRng rng(0);
  for (const auto& part : {held, rest}) {
    for (int64_t i = 0; i < part->size(); ++i) {
      auto x = part->get(i, rng).input.contiguous();
      seen.insert(std::vector<float>(x.data_ptr<float>(), x.data_ptr<float>() + x.numel()));
    }
  }
  EXPECT_EQ(seen.size(), 50u);
  EXPECT_THROW(hddp::examples::randomSubset(base, 45, 3, 10), hddp::ConfigError);
}

}  // namespace

// hddp-plot draws the metrics files of a real 2-rank run (rank 1 emulated slower, with
// an emulated device memory) as PNG and SVG, and says what is wrong with bad input.
TEST(HddpPlot, DrawsATwoRankRunsMetricsAsPngAndSvg) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string metrics = dir + "/metrics.jsonl";
  const auto run = hddp::testing::runCommand(
      "HDDP_DEVICE=cpu " + hddp::testing::toolsDir() + "/hddp-run --nproc-per-node 2 -- " +
      kResnet + " " + kTinyResnet +
      " --emulate-slowdown 1:2 --emulate-memory 1:100+1/400 --threads 1 --progress off "
      "--metrics " +
      metrics);
  ASSERT_EQ(run.exitCode, 0) << run.output;
  const std::string plot = hddp::testing::toolsDir() + "/../hddp-plot/hddp-plot";
  const auto drawn = hddp::testing::runCommand(plot + " " + metrics + " -o " + dir + "/chart");
  ASSERT_EQ(drawn.exitCode, 0) << drawn.output;
  for (const std::string ext : {"png", "svg"}) {
    const std::string path = dir + "/chart." + ext;
    EXPECT_NE(drawn.output.find(path), std::string::npos) << drawn.output;
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    EXPECT_GT(std::filesystem::file_size(path), 20000u) << path;
    std::ifstream in(path, std::ios::binary);
    std::string head(256, '\0');
    in.read(&head[0], static_cast<std::streamsize>(head.size()));
    EXPECT_NE(head.find(ext == "png" ? "PNG" : "<svg"), std::string::npos) << path;
  }
  const auto missing = hddp::testing::runCommand(plot + " " + dir + "/nothing.jsonl");
  EXPECT_EQ(missing.exitCode, 1) << missing.output;
  EXPECT_NE(missing.output.find("no such file"), std::string::npos) << missing.output;
  std::ofstream(dir + "/empty.jsonl") << "{\"kind\":\"config\",\"rank\":0}\n";
  const auto empty = hddp::testing::runCommand(plot + " " + dir + "/empty.jsonl");
  EXPECT_EQ(empty.exitCode, 1) << empty.output;
  EXPECT_NE(empty.output.find("no step records"), std::string::npos) << empty.output;
  const auto format = hddp::testing::runCommand(plot + " " + metrics + " --format gif");
  EXPECT_EQ(format.exitCode, 2) << format.output;
  EXPECT_NE(format.output.find("give png, svg or pdf"), std::string::npos) << format.output;
  removeTree(dir);
}

// Under hddp-run in a terminal, rank 0's live progress bar shows (a pseudo-terminal for
// its stderr, passed through unprefixed) and rank 1's lines stay prefixed, each on a
// line of its own; --no-tty, or no terminal, gives progress lines instead.
TEST(HddpRunTerminal, RankZerosLiveBarShowsAndOtherRanksLinesStayWhole) {
  const std::string run = hddp::testing::toolsDir() + "/hddp-run --nproc-per-node 2 ";
  const std::string trainer = " -- " + kResnet + " " + kTinyResnet + " --threads 1 --progress auto";
  const auto live = hddp::testing::runInTerminal("HDDP_LOG_LEVEL=info " + run + trainer);
  ASSERT_EQ(live.exitCode, 0) << live.output;
  EXPECT_NE(live.output.find("\r\033[Kepoch 1/3 ["), std::string::npos) << live.output;
  EXPECT_EQ(live.output.find("[rank 0] epoch 1/3"), std::string::npos) << live.output;
  // Every line of rank 1 (hddp-run's prefix, then the log line's time stamp) starts a
  // line: after a newline, or after the bar was cleared.
  size_t rank1 = 0;
  for (size_t at = live.output.find("[rank 1] [20"); at != std::string::npos;
       at = live.output.find("[rank 1] [20", at + 1)) {
    ++rank1;
    const bool afterNewline = at > 0 && live.output[at - 1] == '\n';
    const bool afterClear = at >= 4 && live.output.compare(at - 4, 4, "\r\033[K") == 0;
    EXPECT_TRUE(afterNewline || afterClear)
        << "at " << at << ": ..." << live.output.substr(at > 60 ? at - 60 : 0, 80);
  }
  EXPECT_GT(rank1, 0u) << live.output;
  const auto piped = hddp::testing::runInTerminal(run + "--no-tty" + trainer);
  ASSERT_EQ(piped.exitCode, 0) << piped.output;
  EXPECT_EQ(piped.output.find("\033[K"), std::string::npos) << piped.output;
  EXPECT_NE(piped.output.find("[rank 0] epoch 1/3 step"), std::string::npos) << piped.output;
  const auto plain = hddp::testing::runCommand(run + trainer);
  ASSERT_EQ(plain.exitCode, 0) << plain.output;
  EXPECT_EQ(plain.output.find("\033[K"), std::string::npos) << plain.output;
}
