// Trainer runs for the Trainer's tests (tests/train/trainer*_test.cpp): a small model
// with BatchNorm and dropout, one training run configured through the environment (so
// that the children of runProcesses, which re-run the test from the top, take the same
// path), and a StateError's message.
#pragma once

#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"

namespace hddp {
namespace testing {

// A small classifier of 1x8x8 images into 4 classes, with BatchNorm (buffers that a
// state file carries) and a dropout layer.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(6));
    drop = register_module("drop", torch::nn::Dropout(0.0));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn->forward(conv->forward(x)));
    return fc->forward(drop->forward(h.flatten(1)));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// The environment variable `name`, or `fallback` when it is not set.
inline std::string envOr(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// One training run as the tests configure it through the environment (children of
// runProcesses re-run the test from the top, so every phase goes through here).
inline hddp::TrainSummary trainRun(int rank, int size, hddp::Store& store,
                                   const std::function<void(hddp::TrainerOptions&)>& configure,
                                   const std::string& paramsOut = "") {
  auto comm = hddp::makeCommunicator(store, rank, size);
  torch::manual_seed(100 + rank);  // dropout draws differ per rank
  Net model;
  // HDDP_TEST_ZERO="STAGE SHARD_BY" (ZeRO; "0 -" for plain DDP) trains with momentum, so
  // that the optimizer has state to shard, save and load.
  const std::string zero = envOr("HDDP_TEST_ZERO");
  torch::optim::SGD opt(model->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(zero.empty() ? 0.0 : 0.9));
  hddp::TrainerOptions o;
  if (!zero.empty()) {
    o.zero = std::stoi(zero.substr(0, 1));
    if (o.zero > 0) {
      o.shardBy = hddp::parseShardBy(zero.substr(2));
    }
  }
  o.globalBatch = 24;
  o.epochs = 3;
  o.balance = false;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 2;
  configure(o);
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
  hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                        o);
  trainer.setSchedule([](const hddp::StepInfo& info, torch::optim::Optimizer& optimizer) {
    hddp::setLearningRate(optimizer, 0.05 / (1.0 + 0.1 * static_cast<double>(info.step)));
  });
  auto summary = trainer.fit();
  if (rank == 0 && !paramsOut.empty()) {
    std::vector<at::Tensor> state;
    for (const auto& p : model->parameters()) {
      state.push_back(p.detach().clone());
    }
    for (const auto& b : model->buffers()) {
      state.push_back(b.detach().clone());
    }
    torch::save(state, paramsOut);
  }
  return summary;
}

// The message of the StateError that `fn` throws; "(no StateError)" when it throws none.
inline std::string stateError(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const hddp::StateError& e) {
    return e.what_without_backtrace();
  }
  return "(no StateError)";
}

}  // namespace testing
}  // namespace hddp
