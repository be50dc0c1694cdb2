// PowerSGD's memories belong to parameters, not to bucket indices: DDP lays its buckets
// out anew after its first step (in the order the gradients became ready), and a
// resumed run's first step already compresses with the memories it loaded. The
// differential matrix found the memories applied to the wrong parameters there
// (tools/diff-matrix/matrix.py, regression seed 3001).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/power_sgd.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

// Two layers of the same shape, registered a then b and used b then a: their gradients
// become ready a first, so DDP's first layout (reverse registration: b, a) is rebuilt
// after the first step as (a, b), each layer one bucket of the same size.
struct SwappedImpl : torch::nn::Module {
  SwappedImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return a(torch::tanh(b(x))); }
  torch::nn::Linear a{nullptr};
  torch::nn::Linear b{nullptr};
};
TORCH_MODULE(Swapped);

constexpr int kSteps = 6;
constexpr int kSaveAfter = 3;  // steps 0-2 before the save, PowerSGD compressing from step 2
constexpr int64_t kBatch = 8;

struct Training {
  std::shared_ptr<hddp::PowerSgdState> state;
  std::unique_ptr<hddp::DistributedDataParallel> ddp;
  std::unique_ptr<torch::optim::SGD> opt;
};

Training makeRun(Swapped& model, hddp::Communicator& comm) {
  Training run;
  hddp::PowerSgdOptions o;
  o.rank = 1;
  o.startStep = 2;
  o.randomSeed = 11;
  run.state = std::make_shared<hddp::PowerSgdState>(o);
  hddp::DdpOptions opts;
  opts.commHook = hddp::powerSgdHook(run.state);
  opts.firstBucketBytes = (8 * 8 + 8) * 8;  // one layer (float64) per bucket
  opts.bucketCapBytes = (8 * 8 + 8) * 8;
  run.ddp = std::make_unique<hddp::DistributedDataParallel>(model.ptr(), comm, opts);
  run.opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  return run;
}

// Draws from a generator of their own: the ranks are threads of one process, and the
// global generator would be shared between them.
torch::Tensor draw(std::vector<int64_t> shape, uint64_t seed) {
  return torch::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed),
                      torch::TensorOptions().dtype(torch::kDouble));
}

void trainStep(Swapped& model, Training& run, int rank, int step) {
  const torch::Tensor x = draw({kBatch, 8}, 1000 + static_cast<uint64_t>(step));
  const torch::Tensor y = draw({kBatch, 8}, 2000 + static_cast<uint64_t>(step));
  const int64_t local = kBatch / 2;
  run.ddp->setBatch(local, kBatch);
  run.opt->zero_grad();
  torch::mse_loss(model->forward(x.narrow(0, rank * local, local)),
                  y.narrow(0, rank * local, local))
      .backward();
  run.opt->step();
}

std::vector<std::pair<std::string, torch::Tensor>> parametersOf(Swapped& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : model->named_parameters()) {
    out.emplace_back(p.key(), p.value().detach().clone());
  }
  return out;
}

}  // namespace

// A run saved after three steps (parameters and PowerSGD's state) and resumed by a fresh
// model and DDP ends with the parameters of the run that went straight through, to the
// bit. The resumed DDP's first step uses its first layout (b, a), the straight run's the
// rebuilt one (a, b): memories kept per bucket index would land on the other layer.
TEST(PowerSgdResume, MemoriesFollowTheirParametersWhenTheBucketsAreLaidOutAnew) {
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> straight(2);
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> resumed(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    std::vector<std::pair<std::string, torch::Tensor>> start;
    for (const char* name : {"a.weight", "a.bias", "b.weight", "b.bias"}) {
      const bool weight = std::string(name).find("weight") != std::string::npos;
      start.emplace_back(name,
                         0.3 * draw(weight ? std::vector<int64_t>{8, 8} : std::vector<int64_t>{8},
                                    std::hash<std::string>{}(name)));
    }
    auto fresh = [&](const std::vector<std::pair<std::string, torch::Tensor>>& from) {
      Swapped model;
      model->to(torch::kDouble);
      torch::NoGradGuard guard;
      for (const auto& [name, value] : from) {
        model->named_parameters()[name].copy_(value);
      }
      return model;
    };
    // Straight through.
    Swapped one = fresh(start);
    Training a = makeRun(one, *comm);
    const auto firstLayout = a.ddp->bucketLayout();
    for (int step = 0; step < kSteps; ++step) {
      trainStep(one, a, rank, step);
    }
    EXPECT_NE(a.ddp->bucketLayout(), firstLayout) << "the buckets were not laid out anew";
    EXPECT_EQ(a.state->step(), kSteps);
    straight[static_cast<size_t>(rank)] = parametersOf(one);
    // Saved after kSaveAfter steps, resumed by a fresh model, DDP and state.
    Swapped two = fresh(start);
    Training b = makeRun(two, *comm);
    for (int step = 0; step < kSaveAfter; ++step) {
      trainStep(two, b, rank, step);
    }
    ASSERT_TRUE(b.state->compressing());
    const auto saved = b.state->stateDict();
    const auto savedParameters = parametersOf(two);
    Swapped three = fresh(savedParameters);
    Training c = makeRun(three, *comm);
    c.state->loadStateDict(saved);
    EXPECT_EQ(c.ddp->bucketLayout(), firstLayout);
    for (int step = kSaveAfter; step < kSteps; ++step) {
      trainStep(three, c, rank, step);
    }
    resumed[static_cast<size_t>(rank)] = parametersOf(three);
  });
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(straight[r].size(), resumed[r].size());
    for (size_t i = 0; i < straight[r].size(); ++i) {
      const auto& [name, expected] = straight[r][i];
      EXPECT_TRUE(torch::equal(resumed[r][i].second, expected))
          << "rank " << r << ": " << name << " differs from the straight run by up to "
          << (resumed[r][i].second - expected).abs().max().item<double>();
    }
  }
}
