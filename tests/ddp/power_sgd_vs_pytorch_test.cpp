// PowerSGD (hddp/ddp/power_sgd.h) against PyTorch's own powerSGD_hook: the torch wheel's
// hook (tests/ddp/power_sgd_reference.py, 2 Gloo ranks) and hddp's, fed the same
// gradients and the same starting Q, give the same reduced buckets at every step.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/power_sgd.h"
#include "support/power_sgd_steps.h"
#include "support/ranks.h"

namespace {

using hddp::testing::makeBucket;
using hddp::testing::runStep;
using hddp::testing::runThreads;

int freeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    ADD_FAILURE() << "no free loopback port: " << std::strerror(errno);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The reference file power_sgd_reference.py writes: an index and float32 data.
struct Reference {
  nlohmann::json index;
  std::vector<float> data;

  at::Tensor get(const std::string& name) const {
    const auto& t = index.at("tensors").at(name);
    const int64_t offset = t.at("offset").get<int64_t>();
    const int64_t numel = t.at("numel").get<int64_t>();
    return at::from_blob(const_cast<float*>(data.data()) + offset, {numel}, at::kFloat).clone();
  }
};

Reference runPyTorch() {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string command = std::string(HDDP_TEST_PYTHON) + " " + HDDP_TEST_SOURCE_DIR +
                              "/ddp/power_sgd_reference.py " + dir + " " +
                              std::to_string(freeLoopbackPort());
  const auto result = hddp::testing::runCommand("timeout 120 " + command);
  EXPECT_EQ(result.exitCode, 0) << command << "\n" << result.output;
  Reference r;
  std::ifstream json(dir + "/reference.json");
  EXPECT_TRUE(json.good()) << "no reference.json from " << command << "\n" << result.output;
  if (json.good()) {
    r.index = nlohmann::json::parse(json);
  }
  std::ifstream bin(dir + "/reference.bin", std::ios::binary);
  std::stringstream bytes;
  bytes << bin.rdbuf();
  const std::string blob = bytes.str();
  r.data.resize(blob.size() / sizeof(float));
  std::memcpy(r.data.data(), blob.data(), r.data.size() * sizeof(float));
  return r;
}

// PyTorch's Q of a bucket (the compressed gradients' Qs in one tensor, grouped by shape,
// groups in order of first appearance) as hddp's per-parameter memories, under the keys
// of a bucket made by hand ("q/<bucket>.<position>").
void addQMemories(std::vector<std::pair<std::string, at::Tensor>>& out, int bucket,
                  const std::vector<std::vector<int64_t>>& shapes, const at::Tensor& q, int rank,
                  double minRate) {
  std::vector<std::vector<size_t>> groups;                  // positions, grouped by matrix shape
  std::vector<std::array<int64_t, 3>> dims(shapes.size());  // rows, cols, r
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (shapes[i].empty()) {
      continue;
    }
    int64_t cols = 1;
    for (size_t k = 1; k < shapes[i].size(); ++k) {
      cols *= shapes[i][k];
    }
    const int64_t rows = shapes[i][0];
    const int64_t r = std::min<int64_t>({rows, cols, rank});
    if (!(static_cast<double>((rows + cols) * r) * minRate < static_cast<double>(rows * cols))) {
      continue;
    }
    dims[i] = {rows, cols, r};
    bool placed = false;
    for (auto& g : groups) {
      placed = dims[g.front()][0] == rows && dims[g.front()][1] == cols;
      if (placed) {
        g.push_back(i);
        break;
      }
    }
    if (!placed) {
      groups.push_back({i});
    }
  }
  int64_t at = 0;
  for (const auto& g : groups) {
    for (size_t i : g) {
      const int64_t n = dims[i][1] * dims[i][2];
      out.emplace_back("q/" + std::to_string(bucket) + "." + std::to_string(i),
                       q.narrow(0, at, n).clone());
      at += n;
    }
  }
  EXPECT_EQ(at, q.numel()) << "bucket " << bucket;
}

}  // namespace

// PyTorch's powerSGD_hook (the torch wheel, run as a script on 2 Gloo ranks) and hddp's,
// fed the same gradients and the same starting Q, give the same reduced buckets at
// every step: 2 plain steps, then 4 compressed ones with error feedback and warm start,
// two buckets (one with a shape that repeats apart), ranks 1 (Gram-Schmidt) and 3 (QR).
// PyTorch's hook gets each rank's gradient and averages; DDP hands hddp's the gradient
// weighted by the rank's share (here 1/2) and sums: the same numbers.
TEST(PowerSgdVsPyTorch, SameOutputsStepByStepWithErrorFeedbackAndWarmStart) {
  const Reference ref = runPyTorch();
  ASSERT_FALSE(ref.index.is_null());
  const int world = ref.index.at("world").get<int>();
  const int steps = ref.index.at("steps").get<int>();
  const auto shapes = ref.index.at("buckets").get<std::vector<std::vector<std::vector<int64_t>>>>();
  ASSERT_EQ(world, 2);
  for (const auto& config : ref.index.at("configs")) {
    const std::string name = config.at("name").get<std::string>();
    std::vector<double> worst(world, 0.0);
    runThreads(world, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      hddp::PowerSgdOptions o;
      o.rank = config.at("rank").get<int>();
      o.minCompressionRate = config.at("min_rate").get<double>();
      o.startStep = ref.index.at("start").get<int64_t>();
      auto state = std::make_shared<hddp::PowerSgdState>(o);
      const hddp::CommHook hook = hddp::powerSgdHook(state);
      for (int step = 0; step < steps; ++step) {
        if (step == o.startStep) {
          std::vector<std::pair<std::string, at::Tensor>> first;
          for (size_t b = 0; b < shapes.size(); ++b) {
            addQMemories(first, static_cast<int>(b), shapes[b],
                         ref.get("q0." + name + ".bucket" + std::to_string(b)), o.rank,
                         o.minCompressionRate);
          }
          state->loadStateDict(first);
        }
        std::vector<hddp::GradBucket> buckets;
        for (size_t b = 0; b < shapes.size(); ++b) {
          const std::string key = name + ".step" + std::to_string(step) + ".rank" +
                                  std::to_string(rank) + ".bucket" + std::to_string(b);
          buckets.push_back(makeBucket(static_cast<int>(b), b + 1 == shapes.size(), shapes[b],
                                       ref.get("in." + key) / static_cast<double>(world)));
        }
        runStep(hook, *comm, buckets);
        for (size_t b = 0; b < shapes.size(); ++b) {
          const std::string key = name + ".step" + std::to_string(step) + ".rank" +
                                  std::to_string(rank) + ".bucket" + std::to_string(b);
          const at::Tensor expected = ref.get("out." + key);
          const double diff = (buckets[b].buffer - expected).abs().max().item<double>() /
                              (expected.abs().max().item<double>() + 1e-12);
          worst[rank] = std::max(worst[rank], diff);
          EXPECT_LT(diff, 1e-4) << key;
        }
      }
      EXPECT_EQ(state->step(), steps);
      EXPECT_LT(state->elementsAfter(), state->elementsBefore());
    });
    std::printf("%s: largest relative difference to PyTorch's hook: %.2e (rank 0), %.2e (rank 1)\n",
                name.c_str(), worst[0], worst[1]);
  }
}
