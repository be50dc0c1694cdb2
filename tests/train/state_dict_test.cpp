// State dicts for Python (hddp/train/state_dict.h): both formats round-trip parameters
// and buffers exactly, and a file that does not fit names the keys.
#include "hddp/train/state_dict.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "hddp/core/error.h"
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

}  // namespace
