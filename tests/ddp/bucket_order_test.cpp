// DDP's bucket order as a loop of its own saves and restores it: bucketOrder() names the
// parameters in bucket order, setBucketOrder() lays a fresh DDP's buckets out in it and
// keeps them (no rebuild after the first step), refuses names that are not the model's
// parameters without changing anything, and refuses to run in the middle of a step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8, 8)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) {
      x = torch::tanh(layer(x));
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Chain);

hddp::DdpOptions smallBuckets() {
  hddp::DdpOptions options;
  options.firstBucketBytes = 8 * 8 * 4;  // one weight a bucket: several buckets
  options.bucketCapBytes = 8 * 8 * 4;
  return options;
}

void step(Chain& model, hddp::DistributedDataParallel& ddp, int rank) {
  torch::manual_seed(7 + rank);
  ddp.setBatch(4, 8);
  model->forward(torch::randn({4, 8})).sum().backward();
}

// `body` on each of `world` ranks with its chain in a DDP of small buckets.
void onRanks(int world,
             const std::function<void(int, Chain&, hddp::DistributedDataParallel&)>& body) {
  runThreads(world, [&body](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions c;
    c.timeout = std::chrono::seconds(60);  // a rank left behind fails the test, not hangs it
    auto comm = hddp::makeCommunicator(store, rank, size, c);
    Chain model;
    hddp::DistributedDataParallel ddp(model, *comm, smallBuckets());
    body(rank, model, ddp);
  });
}

}  // namespace

TEST(BucketOrder, AnOrderSetOnAFreshDdpIsItsLayoutAndStaysAfterTheFirstStep) {
  onRanks(2, [](int rank, Chain& model, hddp::DistributedDataParallel& ddp) {
    std::vector<std::string> order = ddp.bucketOrder();
    ASSERT_EQ(order.size(), 8u);
    ASSERT_GT(ddp.bucketLayout().size(), 1u);
    // Registration order: not the reverse order DDP starts from, nor (for a chain) the
    // order gradients arrive in, which the first step's rebuild would take.
    std::vector<std::string> wanted = ddp.parameterNames();
    ASSERT_NE(wanted, order);
    ASSERT_TRUE(ddp.setBucketOrder(wanted));
    EXPECT_EQ(ddp.bucketOrder(), wanted);
    const auto layout = ddp.bucketLayout();
    for (int i = 0; i < 3; ++i) {
      step(model, ddp, rank);
    }
    EXPECT_EQ(ddp.bucketLayout(), layout) << "the buckets were rebuilt after the first step";
    EXPECT_EQ(ddp.bucketOrder(), wanted);
  });
}

TEST(BucketOrder, NamesThatAreNotTheModelsParametersChangeNothing) {
  onRanks(1, [](int, Chain&, hddp::DistributedDataParallel& ddp) {
    const auto layout = ddp.bucketLayout();
    std::vector<std::string> names = ddp.parameterNames();
    std::vector<std::string> missing(names.begin(), names.end() - 1);
    std::vector<std::string> doubled = names;
    doubled.back() = doubled.front();
    std::vector<std::string> foreign = names;
    foreign.back() = "l9.bias";
    for (const auto& bad : {missing, doubled, foreign}) {
      EXPECT_FALSE(ddp.setBucketOrder(bad));
      EXPECT_EQ(ddp.bucketLayout(), layout);
    }
  });
}

// A backward that failed part-way (out of memory, say) leaves the step under way, some
// buckets sent: new buckets then would send other collectives than the peers'.
TEST(BucketOrder, IsRefusedWhileAStepIsUnderWay) {
  onRanks(1, [](int, Chain& model, hddp::DistributedDataParallel& ddp) {
    const auto names = ddp.parameterNames();
    ddp.setBatch(4, 4);
    EXPECT_TRUE(ddp.setBucketOrder(names)) << "setBatch() alone sends nothing";
    auto h = torch::tanh(model->layers[1](torch::tanh(model->layers[0](torch::randn({4, 8})))));
    h.register_hook([](const torch::Tensor&) -> torch::Tensor {
      throw std::runtime_error("test: out of memory half-way through backward");
    });
    auto out = torch::tanh(model->layers[3](torch::tanh(model->layers[2](h))));
    EXPECT_THROW(out.sum().backward(), std::exception);
    EXPECT_THROW(ddp.setBucketOrder(names), hddp::ConfigError);
    ddp.abandonStep();
    EXPECT_TRUE(ddp.lastStepAbandoned());
    EXPECT_TRUE(ddp.setBucketOrder(names));
    EXPECT_EQ(ddp.bucketOrder(), names);
  });
}
