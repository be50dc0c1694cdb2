// One rank's small Trainer job for the state-file tests (tests/train/state_*_test.cpp): an
// MLP on 40 synthetic samples of 4 features, global batch 8, SGD with momentum (or a
// subclass of it that a test instruments), the planner on, its communicator's timeout 60 s
// so that a rank left behind fails the test instead of hanging it.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hddp/hddp.h"

namespace hddp {
namespace testing {

template <typename Sgd = torch::optim::SGD>
struct MlpJob {
  std::unique_ptr<Communicator> comm;
  torch::nn::Sequential net;
  std::unique_ptr<Sgd> optimizer;
  std::unique_ptr<Trainer> trainer;

  MlpJob(int rank, int size, Store& store, const std::string& saveDir, int64_t maxSteps) {
    CommunicatorOptions c;
    c.timeout = std::chrono::seconds(60);
    comm = makeCommunicator(store, rank, size, c);
    static std::mutex initialising;  // ranks that are threads draw from one generator
    {
      std::lock_guard<std::mutex> lock(initialising);
      torch::manual_seed(3);
      net = torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(4, 8), torch::nn::Tanh(),
                                  torch::nn::Linear(8, 3));
    }
    optimizer =
        std::make_unique<Sgd>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    TrainerOptions o;
    o.globalBatch = 8;
    o.epochs = 2;
    o.maxSteps = maxSteps;
    o.balance = true;
    o.seedPlan = false;
    o.progress = ProgressMode::Off;
    o.loader.workers = 0;
    o.saveDir = saveDir;
    auto ds = std::make_shared<SyntheticClassificationDataset>(40, 1, 2, 3, /*seed=*/5);
    auto model = net;
    trainer = std::make_unique<Trainer>(
        *comm, net.ptr(), [model](const torch::Tensor& x) mutable { return model->forward(x); },
        crossEntropy(), *optimizer, ds, o);
  }

  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> out;
    for (const auto& p : net->parameters()) {
      out.push_back(p.detach().clone());
    }
    return out;
  }
};

}  // namespace testing
}  // namespace hddp
