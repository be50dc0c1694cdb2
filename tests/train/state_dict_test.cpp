// State dicts for Python (hddp/train/state_dict.h): both formats round-trip parameters
// and buffers exactly, and a file that does not fit names the keys.
#include "hddp/train/state_dict.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "hddp/core/error.h"
#include "support/log_capture.h"
#include "support/ranks.h"

namespace {

struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl(int classes = 4) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 3, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    fc = register_module("fc", torch::nn::Linear(3, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(torch::relu(bn(conv(x))).mean({2, 3}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SmallNet);

void expectSameState(torch::nn::Module& a, torch::nn::Module& b) {
  auto sa = hddp::stateDictOf(a);
  auto sb = hddp::stateDictOf(b);
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(sa[i].second.equal(sb[i].second)) << sa[i].first;
  }
}

class StateDictFormats : public ::testing::TestWithParam<std::string> {};

TEST_P(StateDictFormats, ParametersAndBuffersRoundTripExactly) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string path = dir + "/net" + GetParam();
  torch::manual_seed(1);
  SmallNet a;
  a->train();
  a->forward(torch::randn({4, 1, 6, 6}));  // running statistics and num_batches_tracked move
  hddp::saveStateDict(*a, path);
  const auto file = hddp::readStateDict(path);
  EXPECT_EQ(file.count("bn.running_mean"), 1u);
  EXPECT_EQ(file.at("bn.num_batches_tracked").scalar_type(), torch::kLong);
  EXPECT_EQ(file.at("bn.num_batches_tracked").item<int64_t>(), 1);
  torch::manual_seed(2);
  SmallNet b;
  const auto result = hddp::loadStateDict(*b, path);
  EXPECT_EQ(result.loaded.size(), file.size());
  expectSameState(*a, *b);
}

INSTANTIATE_TEST_SUITE_P(Both, StateDictFormats, ::testing::Values(".pt", ".safetensors"),
                         [](const auto& info) {
                           return info.param == ".pt" ? std::string("Pickle")
                                                      : std::string("Safetensors");
                         });

TEST(StateDict, SafetensorsHasTheLayoutOfTheFormat) {
  const std::string path = hddp::testing::makeTempDir() + "/t.safetensors";
  hddp::writeStateDict(
      {{"w", torch::arange(6, torch::kFloat).view({2, 3})}, {"n", torch::tensor({int64_t{7}})}},
      path);
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_NE(header.find(R"("w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find(R"("n":{"dtype":"I64","shape":[1],"data_offsets":[24,32]})"),
            std::string::npos)
      << header;
  EXPECT_EQ(bytes.size(), 8 + n + 32);
  float third = 0;
  std::memcpy(&third, bytes.data() + 8 + n + 2 * sizeof(float), sizeof(float));
  EXPECT_EQ(third, 2.0f);  // raw little-endian data
}

TEST(StateDict, AFileThatDoesNotFitNamesTheKeysAndSkipPrefixesLeavesAHeadOut) {
  const std::string dir = hddp::testing::makeTempDir();
  SmallNet four(4);
  hddp::saveStateDict(*four, dir + "/four.pt");
  SmallNet ten(10);
  try {
    hddp::loadStateDict(*ten, dir + "/four.pt");
    ADD_FAILURE() << "a 4-class head loaded into a 10-class one";
  } catch (const hddp::StateError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("fc.weight (file [4, 3], model [10, 3])"), std::string::npos) << m;
    EXPECT_NE(m.find("four.pt"), std::string::npos) << m;
  }
  hddp::LoadStateDictOptions skipHead;
  skipHead.skipPrefixes = {"fc."};
  const auto result = hddp::loadStateDict(*ten, dir + "/four.pt", skipHead);
  EXPECT_EQ(result.loaded.size(), 7u);  // conv 2, bn 5
  EXPECT_TRUE(ten->conv->weight.equal(four->conv->weight));
  // A file without the head: strict names the missing keys; not strict lists them.
  hddp::writeStateDict({{"conv.weight", four->conv->weight.detach()}}, dir + "/part.safetensors");
  try {
    hddp::loadStateDict(*ten, dir + "/part.safetensors");
    ADD_FAILURE() << "a partial file loaded strictly";
  } catch (const hddp::StateError& e) {
    EXPECT_NE(std::string(e.what()).find("missing 'conv.bias'"), std::string::npos) << e.what();
  }
  hddp::LoadStateDictOptions loose;
  loose.strict = false;
  const auto partial = hddp::loadStateDict(*ten, dir + "/part.safetensors", loose);
  EXPECT_EQ(partial.loaded, (std::vector<std::string>{"conv.weight"}));
  EXPECT_EQ(partial.missing.size(), 8u);
  std::ofstream(dir + "/junk.safetensors") << "not a state dict";
  EXPECT_THROW(hddp::readStateDict(dir + "/junk.safetensors"), hddp::StateError);
  std::ofstream(dir + "/junk.pt") << "not a state dict";
  EXPECT_THROW(hddp::readStateDict(dir + "/junk.pt"), hddp::StateError);
}

// The model's state dict with some tensors in other dtypes, as a safetensors file.
std::string writeWithDtypes(const torch::nn::Module& model, const std::string& path,
                            const std::map<std::string, torch::Dtype>& dtypes) {
  auto state = hddp::stateDictOf(model);
  for (auto& [key, tensor] : state) {
    const auto it = dtypes.find(key);
    if (it != dtypes.end()) {
      tensor = tensor.to(it->second);
    }
  }
  hddp::writeStateDict(state, path);
  return path;
}

// float16 and float64 files load into a float32 model, and the log says which keys
// were converted, from and to what, in one warning of bounded length (#52 item 4).
TEST(StateDict, ConvertedDtypesAreNamedInOneWarning) {
  const std::string dir = hddp::testing::makeTempDir();
  torch::manual_seed(4);
  SmallNet source;
  const std::string path =
      writeWithDtypes(*source, dir + "/mixed.safetensors",
                      {{"conv.weight", torch::kHalf}, {"conv.bias", torch::kDouble}});
  SmallNet model;
  hddp::LoadStateDictResult result;
  {
    hddp::testing::LogCapture capture;
    result = hddp::loadStateDict(*model, path);
    const auto warnings = capture.lines(hddp::log::Level::Warn, "converted");
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find("converted 2 tensor(s) to the model's dtype: 'conv.weight "
                               "(float16 -> float32)', 'conv.bias (float64 -> float32)'"),
              std::string::npos)
        << warnings[0];
    EXPECT_NE(warnings[0].find("mixed.safetensors"), std::string::npos) << warnings[0];
  }
  EXPECT_EQ(result.converted, (std::vector<std::string>{"conv.weight (float16 -> float32)",
                                                        "conv.bias (float64 -> float32)"}));
  EXPECT_EQ(model->conv->weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(model->conv->weight.equal(source->conv->weight.to(torch::kHalf).to(torch::kFloat)));
  EXPECT_TRUE(model->fc->weight.equal(source->fc->weight));
  // Ten converted keys: eight named, and the count.
  torch::nn::Sequential deep;
  for (int i = 0; i < 5; ++i) {
    deep->push_back(torch::nn::Linear(2, 2));
  }
  hddp::saveStateDict(*deep, dir + "/deep.safetensors");
  deep->to(torch::kDouble);
  hddp::testing::LogCapture capture;
  EXPECT_EQ(hddp::loadStateDict(*deep, dir + "/deep.safetensors").converted.size(), 10u);
  const auto warnings = capture.lines(hddp::log::Level::Warn, "converted 10 tensor(s)");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("'3.bias (float32 -> float64)', ... (10 in all)"), std::string::npos)
      << warnings[0];
  EXPECT_EQ(warnings[0].find("'4.weight"), std::string::npos) << warnings[0];
}

// An int32 fc.weight would be read as floats (or floats truncated into an integer
// buffer): refused before anything is copied, naming the keys and both dtypes and the
// option; loaded when asked.
TEST(StateDict, IntegerToFloatAndFloatToIntegerAreRefusedUnlessAllowed) {
  const std::string dir = hddp::testing::makeTempDir();
  torch::manual_seed(5);
  SmallNet source;
  {
    torch::NoGradGuard g;
    source->fc->weight.copy_(torch::randint(-3, 4, {4, 3}));
    source->bn->running_var.fill_(2.75);
  }
  const std::string path = writeWithDtypes(*source, dir + "/ints.safetensors",
                                           {{"fc.weight", torch::kInt},
                                            {"bn.num_batches_tracked", torch::kDouble},
                                            {"conv.bias", torch::kDouble}});
  SmallNet model;
  const auto before = model->conv->weight.clone();
  try {
    hddp::loadStateDict(*model, path);
    ADD_FAILURE() << "an int32 weight loaded into a float32 one without a word";
  } catch (const hddp::StateError& e) {
    const std::string m = e.what();
    for (const char* part :
         {"ints.safetensors", "'fc.weight (int32 -> float32)'",
          "'bn.num_batches_tracked (float64 -> int64)'",
          "LoadStateDictOptions::allowIntegerFloatConversion", "--init-allow-int-float"}) {
      EXPECT_NE(m.find(part), std::string::npos) << part << " in " << m;
    }
    EXPECT_EQ(m.find("conv.bias"), std::string::npos) << m;  // float64 -> float32 is fine
  }
  EXPECT_TRUE(model->conv->weight.equal(before));  // nothing copied
  hddp::LoadStateDictOptions allow;
  allow.allowIntegerFloatConversion = true;
  const auto result = hddp::loadStateDict(*model, path, allow);
  EXPECT_EQ(result.converted.size(), 3u);
  EXPECT_TRUE(model->fc->weight.equal(source->fc->weight));
  EXPECT_TRUE(model->conv->weight.equal(source->conv->weight));
}

}  // namespace
