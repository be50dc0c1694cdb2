// hddp-probe --what-if end to end: a what-if file with its own devices and links, a saved
// profile, the JSON and SVG outputs; ZeRO's shards; a model counted by name; errors for
// bad input.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "hddp/balance/what_if.h"
#include "support/ranks.h"
#include "support/what_if_golden.h"

namespace {

std::string probe() { return hddp::testing::toolsDir() + "/../hddp-probe/hddp-probe"; }

// A fresh folder, removed by the test (std::filesystem::remove_all is avoided: the
// torch wheel's libtorch.so exports a broken copy of it).
std::string tempDir() { return hddp::testing::makeTempDir(); }

void removeDir(const std::string& dir) {
  ASSERT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0) << dir;
}

// The golden case of tests/balance/what_if_test.cpp (worked out there by hand), through
// the command line: the file's own entries, the profile file and --efficiency reach
// the prediction, and the split, step and verdict come back in the JSON.
TEST(HddpProbeWhatIf, AFileWithItsOwnEntriesAndASavedProfileGiveTheGoldenPrediction) {
  const std::string dir = tempDir();
  const std::string table = hddp::testing::goldenTableJson();
  std::ofstream(dir + "/mix.json")
      << R"({"mix": ["fast@wide", "slow@narrow"],)" << table.substr(table.find('{') + 1);
  const hddp::ModelProfile p = hddp::testing::goldenProfile();
  std::ofstream(dir + "/profile.json") << p.toJson();
  const auto r = hddp::testing::runCommand(
      probe() + " --what-if " + dir + "/mix.json --profile " + dir +
      "/profile.json --efficiency 0.5 --memory-traffic 0 --global-batch 256 --json --svg " + dir +
      "/chart.svg 2>&1");
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["split"], nlohmann::json::parse("[195, 61]"));
  EXPECT_NEAR(j["step_s"].get<double>(), 0.131, 1e-9);
  EXPECT_NEAR(j["exposed_allreduce_s"].get<double>(), 0.048, 1e-9);
  EXPECT_TRUE(j["equal_split_samples_per_s"].is_null());
  EXPECT_EQ(j["fastest_alone"]["device"], "fast");
  EXPECT_EQ(j["devices"][1]["memory_cap"], 61);
  EXPECT_NE(j["advice"].dump().find("slows the rest of the mix by 18%"), std::string::npos)
      << j["advice"];
  std::ifstream svg(dir + "/chart.svg");
  const std::string chart((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(chart.find("<svg"), std::string::npos);
  EXPECT_NE(chart.find("slow @ narrow (61)"), std::string::npos) << chart;
  EXPECT_NE(chart.find("allreduce exposed 48.00 ms"), std::string::npos) << chart;
  removeDir(dir);
}

// The golden case under ZeRO-2 with equal shards: each card keeps the 1e8 B of weights,
// half of the gradients and half of the momentum (5e7 B each), 2e8 B in all against the
// plain 3e8, so the slow card's cap rises from 61 to (2764.8 - 512 - 190.73 MiB) / 32 MiB
// = 64.4 -> 64. The JSON and the table carry each card's parts and share.
TEST(HddpProbeWhatIf, ZeroShardsShowPerCard) {
  const std::string dir = tempDir();
  const std::string table = hddp::testing::goldenTableJson();
  std::ofstream(dir + "/mix.json")
      << R"({"mix": ["fast@wide", "slow@narrow"],)" << table.substr(table.find('{') + 1);
  std::ofstream(dir + "/profile.json") << hddp::testing::goldenProfile().toJson();
  const std::string args = " --what-if " + dir + "/mix.json --profile " + dir +
                           "/profile.json --efficiency 0.5 --memory-traffic 0 --zero 2";
  auto r = hddp::testing::runCommand(probe() + args + " --shard-by equal --json 2>&1");
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["zero"], 2);
  EXPECT_EQ(j["shard_by"], "equal");
  const auto& slow = j["devices"][1];
  EXPECT_EQ(slow["memory_cap"], 64);
  EXPECT_EQ(slow["share_of_state"], 0.5);
  EXPECT_EQ(slow["parameter_bytes"], 1e8);
  EXPECT_EQ(slow["gradient_bytes"], 5e7);
  EXPECT_EQ(slow["state_bytes"], 5e7);
  EXPECT_EQ(slow["activation_bytes"],
            32.0 * (1 << 20) * static_cast<double>(j["split"][1].get<int64_t>()));

  r = hddp::testing::runCommand(probe() + args + " --shard-by 1:3 2>&1");
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("ZeRO-2, shards by 1:3 (GiB):"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  slow             0.09       0.07       0.07"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("75.0%"), std::string::npos) << r.output;

  r = hddp::testing::runCommand(probe() + args + " --shard-by 1:x 2>&1");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("--shard-by '1:x': 'x' is not a number >= 0"), std::string::npos)
      << r.output;
  r = hddp::testing::runCommand(probe() + args + " --shard-by 1:2:3 2>&1");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("gives 3 ratios for 2 devices"), std::string::npos) << r.output;
  r = hddp::testing::runCommand(probe() + args + " --compress fp16 2>&1");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("cannot be combined with gradient compression"), std::string::npos)
      << r.output;
  removeDir(dir);
}

// ResNet-20 on 32x32 (He et al. 2016): about 41 M multiply-adds forward, 0.27 M
// parameters; the profile counts them from the model.
TEST(HddpProbeWhatIf, AModelByNameIsCountedFromItsLayers) {
  const std::string dir = tempDir();
  const auto r =
      hddp::testing::runCommand(probe() +
                                " --what-if rtx4090@pcie4x16,rtx3060@tb3 --model resnet20 "
                                "--input 3x32x32 --json --save-profile " +
                                dir + "/r20.json 2>&1");
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const double forward = j["model"]["forward_flops_per_sample"];
  EXPECT_GT(forward, 2 * 40e6);
  EXPECT_LT(forward, 2 * 42e6);
  const double train = j["model"]["train_flops_per_sample"];
  EXPECT_GT(train, 2.5 * forward) << "backward: about twice the forward, less the first layer";
  EXPECT_LT(train, 3.0 * forward);
  const double params = j["model"]["parameter_bytes"];
  EXPECT_NEAR(params / 4, 0.27e6, 0.01e6);
  EXPECT_GT(j["model"]["activation_bytes_per_sample"].get<double>(), 0.0);
  EXPECT_EQ(j["devices"].size(), 2u);
  EXPECT_GT(j["split"][0].get<int64_t>(), j["split"][1].get<int64_t>());
  EXPECT_TRUE(std::filesystem::exists(dir + "/r20.json"));
  removeDir(dir);
}

TEST(HddpProbeWhatIf, BadInputSaysWhatWasWrong) {
  auto run = [](const std::string& args) {
    return hddp::testing::runCommand(probe() + " " + args + " 2>&1");
  };
  auto r = run("--what-if rtx4090,rtx3060@tb2 --model resnet20");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("no link 'tb2' in the device table (did you mean 'tb3'?"),
            std::string::npos)
      << r.output;
  r = run("--what-if rtx4090 --model resnet51");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("--model resnet51 is not one of resnet9"), std::string::npos) << r.output;
  r = run("--what-if rtx4090 --model resnet20 --input 3x32");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("C x S x S"), std::string::npos) << r.output;
  r = run("--what-if rtx4090");
  EXPECT_NE(r.exitCode, 0);
  EXPECT_NE(r.output.find("--what-if needs a model"), std::string::npos) << r.output;
  r = run("--list-devices");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("rtx4090"), std::string::npos);
  EXPECT_NE(r.output.find("Thunderbolt 3"), std::string::npos);
}

// A user's own model as TorchScript (here scripted in C++; in Python
// torch.jit.script(model).save(...)): one 12 -> 10 product, 2 x 12 x 10 = 240 FLOPs
// forward per sample, and 240 more for the weight's gradient.
TEST(HddpProbeWhatIf, AUsersTorchScriptModelIsProfiled) {
  const std::string dir = tempDir();
  torch::jit::Module m("Net");
  m.register_parameter("w", torch::randn({10, 12}).requires_grad_(), /*is_buffer=*/false);
  m.define(R"(
def forward(self, x):
    return torch.mm(x.flatten(1), self.w.t())
)");
  m.save(dir + "/net.pt");
  const auto r = hddp::testing::runCommand(probe() + " --what-if rtx3060@tb3 --model-file " + dir +
                                           "/net.pt --input 3x2x2 --json 2>&1");
  ASSERT_EQ(r.exitCode, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"]["forward_flops_per_sample"], 240.0);
  EXPECT_EQ(j["model"]["train_flops_per_sample"], 480.0);
  EXPECT_EQ(j["model"]["parameter_bytes"], 480.0);
  EXPECT_EQ(j["model"]["input_bytes_per_sample"], 48.0);
  EXPECT_EQ(j["model"]["model"], "net.pt 3x2x2");
  const auto noInput = hddp::testing::runCommand(probe() + " --what-if rtx3060 --model-file " +
                                                 dir + "/net.pt 2>&1");
  EXPECT_NE(noInput.exitCode, 0);
  EXPECT_NE(noInput.output.find("--model-file needs --input"), std::string::npos) << noInput.output;
  removeDir(dir);
}

}  // namespace
