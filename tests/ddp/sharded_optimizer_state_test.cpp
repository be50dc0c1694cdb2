// ZeRO state files (ShardedOptimizer::saveShard / loadShards) keep what LibTorch's
// optimizer.save() keeps for a whole optimizer: the state of every parameter and the
// options of every parameter group (a schedule's learning rate, weight decay, momentum,
// betas, eps, nesterov, amsgrad), through a re-sharding from 3 ranks into 2; a file made
// for other parameter groups is a StateError; an old part without groups still loads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <sstream>
#include <string>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    fc2 = register_module("fc2", torch::nn::Linear(12, 12));
    fc3 = register_module("fc3", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::tanh(fc2(torch::tanh(fc1(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

std::mutex seedMutex;  // models built on several threads share the global generator

Net makeNet() {
  std::lock_guard<std::mutex> lock(seedMutex);
  torch::manual_seed(5);
  Net net;
  net->to(torch::kDouble);
  return net;
}

enum class Opt { Sgd, Adam, AdamW };

// Which parameters each group holds: {fc1, fc2} and {fc3}, or others for the refusals.
enum class Groups { Two, One, Moved, FewerParams };

std::vector<std::vector<torch::Tensor>> groupParams(Net& net, Groups groups) {
  auto params = [](torch::nn::Linear& l) { return l->parameters(); };
  auto join = [](std::vector<torch::Tensor> a, const std::vector<torch::Tensor>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  switch (groups) {
    case Groups::Two:
      return {join(params(net->fc1), params(net->fc2)), params(net->fc3)};
    case Groups::One:
      return {net->parameters()};
    case Groups::Moved:
      return {params(net->fc1), join(params(net->fc2), params(net->fc3))};
    case Groups::FewerParams:
      return {join(params(net->fc1), params(net->fc2)), {net->fc3->weight}};
  }
  return {};
}

// The options the program builds the optimizer with: different per group, with
// amsgrad on in the second Adam group.
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(Opt opt, Net& net,
                                                       Groups groups = Groups::Two) {
  std::vector<torch::optim::OptimizerParamGroup> built;
  int g = 0;
  for (auto& params : groupParams(net, groups)) {
    const double lr = g == 0 ? 0.05 : 0.02;
    switch (opt) {
      case Opt::Sgd:
        built.emplace_back(params,
                           std::make_unique<torch::optim::SGDOptions>(
                               torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(1e-3)));
        break;
      case Opt::Adam:
        built.emplace_back(params, std::make_unique<torch::optim::AdamOptions>(
                                       torch::optim::AdamOptions(lr / 5).amsgrad(g == 1)));
        break;
      case Opt::AdamW:
        built.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(
                                       torch::optim::AdamWOptions(lr / 5)));
        break;
    }
    ++g;
  }
  switch (opt) {
    case Opt::Sgd:
      return std::make_unique<torch::optim::SGD>(built, torch::optim::SGDOptions(0.05));
    case Opt::Adam:
      return std::make_unique<torch::optim::Adam>(built, torch::optim::AdamOptions());
    case Opt::AdamW:
      return std::make_unique<torch::optim::AdamW>(built, torch::optim::AdamWOptions());
  }
  return nullptr;
}

// What a schedule and a user changed after step 2: every option the kind has.
void changeOptions(Opt opt, torch::optim::Optimizer& optimizer) {
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto& options = optimizer.param_groups()[g].options();
    options.set_lr(options.get_lr() * (g == 0 ? 0.1 : 0.3));
    if (opt == Opt::Sgd) {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      o.weight_decay(5e-3).momentum(0.5).nesterov(g == 1).dampening(0);
    } else if (opt == Opt::Adam) {
      auto& o = static_cast<torch::optim::AdamOptions&>(options);
      o.weight_decay(2e-3).betas({0.8, 0.95}).eps(1e-6);
    } else {
      auto& o = static_cast<torch::optim::AdamWOptions&>(options);
      o.weight_decay(0.05).betas({0.85, 0.99}).eps(1e-7).amsgrad(false);
    }
  }
}

constexpr int64_t kGlobal = 20;

struct Batch {
  torch::Tensor x, y;
};

Batch batchOf(int step) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  return {torch::randn({kGlobal, 6}, g, torch::kDouble), torch::randint(0, 3, {kGlobal}, g)};
}

// Shares of the global batch: 3 ranks before the save, 2 after (or 1 alone).
std::vector<int64_t> sharesOf(int ranks, int step) {
  if (ranks == 1) {
    return {kGlobal};
  }
  if (ranks == 3) {
    return step % 2 == 1 ? std::vector<int64_t>{7, 13, 0} : std::vector<int64_t>{3, 9, 8};
  }
  return {12, 8};
}

void shardedStep(int rank, int ranks, int step, Net& net, hddp::DistributedDataParallel& ddp,
                 hddp::ShardedOptimizer& sharded) {
  const auto shares = sharesOf(ranks, step);
  int64_t begin = 0;
  for (int r = 0; r < rank; ++r) {
    begin += shares[r];
  }
  const Batch b = batchOf(step);
  ddp.setBatch(shares[rank], kGlobal);
  sharded.zeroGrad();
  if (shares[rank] == 0) {
    ddp.finalize();
  } else {
    torch::cross_entropy_loss(net->forward(b.x.narrow(0, begin, shares[rank])),
                              b.y.narrow(0, begin, shares[rank]))
        .backward();
  }
  sharded.step();
}

void singleStep(int step, Net& net, torch::optim::Optimizer& optimizer) {
  const Batch b = batchOf(step);
  optimizer.zero_grad();
  torch::cross_entropy_loss(net->forward(b.x), b.y).backward();
  optimizer.step();
}

std::vector<torch::Tensor> parametersOf(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

void copyInto(Net& net, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard g;
  auto mine = net->parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    mine[i].copy_(values[i]);
  }
}

double maxDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  }
  return d;
}

// Reference: one device, 2 steps, the options changed, optimizer.save(), a fresh
// optimizer built with the program's options and optimizer.load(), 2 more steps.
std::vector<torch::Tensor> resumedOnOneDevice(Opt opt, std::vector<double>* loadedLrs) {
  Net net = makeNet();
  auto optimizer = makeOptimizer(opt, net);
  for (int s = 0; s < 2; ++s) {
    singleStep(s, net, *optimizer);
  }
  changeOptions(opt, *optimizer);
  torch::serialize::OutputArchive out;
  optimizer->save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  auto fresh = makeOptimizer(opt, net);
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  fresh->load(in);
  for (auto& group : fresh->param_groups()) {
    loadedLrs->push_back(group.options().get_lr());
  }
  for (int s = 2; s < 4; ++s) {
    singleStep(s, net, *fresh);
  }
  return parametersOf(net);
}

class ShardedOptimizerState : public ::testing::TestWithParam<Opt> {};

// Saved by 3 ranks (shards 1:0:3) after the options changed, loaded by 2 ranks into an
// optimizer built with the program's options: the groups get the saved options, as
// optimizer.load() gives them, and 2 more steps equal the one-device resumed run.
TEST_P(ShardedOptimizerState, GroupOptionsComeBackAsOptimizerLoadGivesThemAcrossAReshard) {
  const Opt opt = GetParam();
  std::vector<double> expectedLrs;
  const auto expected = resumedOnOneDevice(opt, &expectedLrs);
  std::vector<std::vector<uint8_t>> parts(3);
  std::vector<torch::Tensor> saved;
  std::mutex savedMutex;
  runThreads(3, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    auto optimizer = makeOptimizer(opt, net);
    hddp::ShardedOptimizerOptions zero;
    zero.weights = {1.0, 0.0, 3.0};
    hddp::ShardedOptimizer sharded(ddp, *optimizer, zero);
    for (int s = 0; s < 2; ++s) {
      shardedStep(rank, 3, s, net, ddp, sharded);
    }
    changeOptions(opt, *optimizer);
    parts[rank] = sharded.saveShard();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(savedMutex);
      saved = parametersOf(net);
    }
  });
  std::vector<double> diffs(2, 1e9);
  std::vector<std::vector<double>> lrs(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    copyInto(net, saved);
    hddp::DistributedDataParallel ddp(net, *comm);
    auto optimizer = makeOptimizer(opt, net);  // the program's options
    hddp::ShardedOptimizer sharded(ddp, *optimizer, {});
    sharded.loadShards(parts);
    // Every option, compared with what optimizer.load() made of the same change.
    Net plainNet = makeNet();
    auto plain = makeOptimizer(opt, plainNet);
    changeOptions(opt, *plain);
    for (size_t g = 0; g < plain->param_groups().size(); ++g) {
      const auto& mine = optimizer->param_groups()[g].options();
      const auto& want = plain->param_groups()[g].options();
      lrs[rank].push_back(mine.get_lr());
      if (opt == Opt::Sgd) {
        EXPECT_TRUE(static_cast<const torch::optim::SGDOptions&>(mine) ==
                    static_cast<const torch::optim::SGDOptions&>(want))
            << "group " << g;
      } else if (opt == Opt::Adam) {
        EXPECT_TRUE(static_cast<const torch::optim::AdamOptions&>(mine) ==
                    static_cast<const torch::optim::AdamOptions&>(want))
            << "group " << g;
      } else {
        EXPECT_TRUE(static_cast<const torch::optim::AdamWOptions&>(mine) ==
                    static_cast<const torch::optim::AdamWOptions&>(want))
            << "group " << g;
      }
    }
    for (int s = 2; s < 4; ++s) {
      shardedStep(rank, 2, s, net, ddp, sharded);
    }
    diffs[rank] = maxDiff(parametersOf(net), expected);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(lrs[r], expectedLrs) << "rank " << r;
    EXPECT_LT(diffs[r], 1e-12) << "rank " << r;
  }
}

std::string optName(const ::testing::TestParamInfo<Opt>& info) {
  switch (info.param) {
    case Opt::Sgd:
      return "Sgd";
    case Opt::Adam:
      return "Adam";
    case Opt::AdamW:
      return "AdamW";
  }
  return "?";
}

INSTANTIATE_TEST_SUITE_P(Zero, ShardedOptimizerState,
                         ::testing::Values(Opt::Sgd, Opt::Adam, Opt::AdamW), optName);

// Parts saved by 2 ranks with groups {fc1, fc2}, {fc3}.
std::vector<std::vector<uint8_t>> twoGroupParts() {
  std::vector<std::vector<uint8_t>> parts(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    auto optimizer = makeOptimizer(Opt::Sgd, net);
    hddp::ShardedOptimizer sharded(ddp, *optimizer, {});
    shardedStep(rank, 2, 0, net, ddp, sharded);
    parts[rank] = sharded.saveShard();
  });
  return parts;
}

// The error loading `parts` into one rank whose optimizer has `groups`, with its first
// group's learning rate after the failed load.
std::string loadError(const std::vector<std::vector<uint8_t>>& parts, Groups groups,
                      double* lrAfter) {
  std::string error;
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    auto optimizer = makeOptimizer(Opt::Sgd, net, groups);
    optimizer->param_groups()[0].options().set_lr(0.125);
    hddp::ShardedOptimizer sharded(ddp, *optimizer, {});
    try {
      sharded.loadShards(parts);
    } catch (const hddp::StateError& e) {
      error = e.what_without_backtrace();
    }
    *lrAfter = optimizer->param_groups()[0].options().get_lr();
  });
  return error;
}

TEST(ShardedOptimizerStateGroups, AFileOfOtherParameterGroupsIsAStateErrorThatChangesNothing) {
  const auto parts = twoGroupParts();
  double lr = 0;
  // The same groups load (and the saved learning rate replaces the program's).
  EXPECT_EQ(loadError(parts, Groups::Two, &lr), "");
  EXPECT_EQ(lr, 0.05);
  std::string e = loadError(parts, Groups::One, &lr);
  EXPECT_NE(e.find("saved by an optimizer with 2 parameter group(s); this one has 1"),
            std::string::npos)
      << e;
  EXPECT_EQ(lr, 0.125) << "a refused file leaves the optimizer as it was";
  e = loadError(parts, Groups::Moved, &lr);
  EXPECT_NE(e.find("'fc2.weight' was in parameter group 0 when saved and is in parameter group 1"),
            std::string::npos)
      << e;
  EXPECT_EQ(lr, 0.125);
  e = loadError(parts, Groups::FewerParams, &lr);
  EXPECT_NE(e.find("'fc3.bias' was in parameter group 1 when saved and is in no parameter group"),
            std::string::npos)
      << e;
}

// A file that fails on a parameter's state (here fc3 has 36 elements there and 48 in this
// model) changes nothing either: the states this optimizer had stay. Before, the shard's
// states were erased first, so a refused file left the parameters without momentum.
TEST(ShardedOptimizerStateGroups, AFileThatFailsOnAParametersStateKeepsTheStatesThereWere) {
  struct WideImpl : torch::nn::Module {
    WideImpl() {
      fc1 = register_module("fc1", torch::nn::Linear(6, 12));
      fc2 = register_module("fc2", torch::nn::Linear(12, 12));
      fc3 = register_module("fc3", torch::nn::Linear(12, 4));
    }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  };
  const auto parts = twoGroupParts();
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto net = std::make_shared<WideImpl>();
    net->to(torch::kDouble);
    hddp::DistributedDataParallel ddp(net, *comm);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto first = net->fc1->parameters();
    for (const auto& p : net->fc2->parameters()) {
      first.push_back(p);
    }
    groups.emplace_back(first, std::make_unique<torch::optim::SGDOptions>(
                                   torch::optim::SGDOptions(0.05).momentum(0.9)));
    groups.emplace_back(net->fc3->parameters(), std::make_unique<torch::optim::SGDOptions>(
                                                    torch::optim::SGDOptions(0.02).momentum(0.9)));
    torch::optim::SGD sgd(groups, torch::optim::SGDOptions(0.05));
    hddp::ShardedOptimizer sharded(ddp, sgd, {});
    const auto x = torch::randn({4, 6}, torch::kDouble);
    ddp.setBatch(4, 4);
    sharded.zeroGrad();
    torch::cross_entropy_loss(net->fc3(torch::tanh(net->fc2(torch::tanh(net->fc1(x))))),
                              torch::zeros({4}, torch::kLong))
        .backward();
    sharded.step();
    ASSERT_EQ(sgd.state().size(), net->parameters().size());
    std::string error;
    try {
      sharded.loadShards(parts);
    } catch (const hddp::StateError& e) {
      error = e.what_without_backtrace();
    }
    EXPECT_NE(error.find("elements there"), std::string::npos) << error;
    EXPECT_EQ(sgd.state().size(), net->parameters().size())
        << "a refused file took the optimizer's states away";
  });
}

// A part as hddp wrote it before the groups were kept (format 1): states only. It loads;
// the options stay the program's (and a warning says so).
TEST(ShardedOptimizerStateGroups, AnOldPartWithoutGroupsLoadsWithTheProgramsOptions) {
  std::vector<uint8_t> oldPart;
  std::vector<torch::Tensor> momenta;
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    auto optimizer = makeOptimizer(Opt::Sgd, net);
    hddp::ShardedOptimizer sharded(ddp, *optimizer, {});
    shardedStep(0, 1, 0, net, ddp, sharded);
    torch::serialize::OutputArchive archive;
    archive.write("format", at::tensor(int64_t{1}));
    archive.write("optimizer", at::tensor(int64_t{0}));  // sgd
    const auto params = ddp.parameters();
    const auto names = ddp.parameterNames();
    std::vector<int64_t> indices;
    std::vector<int64_t> numels;
    std::string joined;
    for (size_t i = 0; i < params.size(); ++i) {
      torch::serialize::OutputArchive one;
      optimizer->state().at(params[i].unsafeGetTensorImpl())->serialize(one);
      archive.write("p" + std::to_string(i), one);
      indices.push_back(static_cast<int64_t>(i));
      numels.push_back(params[i].numel());
      joined += names[i] + "\n";
      momenta.push_back(static_cast<torch::optim::SGDParamState&>(
                            *optimizer->state().at(params[i].unsafeGetTensorImpl()))
                            .momentum_buffer()
                            .clone());
    }
    archive.write("parameters", at::tensor(indices, at::kLong));
    archive.write("numels", at::tensor(numels, at::kLong));
    archive.write(
        "names",
        at::from_blob(joined.data(), {static_cast<int64_t>(joined.size())}, at::kByte).clone());
    std::ostringstream out;
    archive.save_to(out);
    const std::string s = out.str();
    oldPart.assign(s.begin(), s.end());
  });
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    auto optimizer = makeOptimizer(Opt::Sgd, net);
    optimizer->param_groups()[1].options().set_lr(0.25);
    hddp::ShardedOptimizer sharded(ddp, *optimizer, {});
    sharded.loadShards({oldPart});
    EXPECT_EQ(optimizer->param_groups()[0].options().get_lr(), 0.05);
    EXPECT_EQ(optimizer->param_groups()[1].options().get_lr(), 0.25);
    const auto params = ddp.parameters();
    const auto& layout = sharded.layout();
    for (size_t i = 0; i < params.size(); ++i) {
      if (layout.owner[i] != rank) {
        continue;
      }
      const auto& state = static_cast<torch::optim::SGDParamState&>(
          *optimizer->state().at(params[i].unsafeGetTensorImpl()));
      EXPECT_TRUE(state.momentum_buffer().equal(momenta[i])) << i;
    }
  });
}

}  // namespace
