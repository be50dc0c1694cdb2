// DDP under the uses a review found wrong: a second backward or a finalize() after
// backward, tied parameters, a model loaded after wrapping, a rank that runs an empty
// batch, a module on two devices, sparse gradients. Each result is checked against
// single-device training on the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <sstream>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runProcesses;
using hddp::testing::runThreads;

torch::nn::Sequential makeNet() {
  return torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::Tanh(),
                               torch::nn::Linear(12, 3));
}

void copyParams(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    p.value().copy_(src[p.key()]);
  }
}

std::vector<torch::Tensor> gradsOf(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) {
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  return out;
}

double maxGradDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!a[i].defined() || !b[i].defined()) {
      return 1e9;
    }
    const double here = (a[i] - b[i]).abs().max().item<double>();
    if (std::isnan(here)) {
      return 1e9;  // std::max would drop a NaN
    }
    d = std::max(d, here);
  }
  return d;
}

torch::Tensor loss(torch::nn::Sequential& net, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::cross_entropy_loss(net->forward(x), y);
}

struct Batch {
  torch::Tensor x, y;
  Batch slice(int64_t start, int64_t n) const {
    return {x.narrow(0, start, n), y.narrow(0, start, n)};
  }
};

Batch makeBatch(int64_t n, int seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 6}), torch::randint(0, 3, {n}, torch::kLong)};
}

// Runs `world` ranks (threads), each with a model from `make` that starts as
// `reference` and a DDP wrapper around it; `step` trains this rank's part. Expects every
// rank's gradients to equal `expected` (single-device training on the whole batch).
template <typename Holder, typename Step>
void expectGradientsOfTheWholeBatch(int world, Holder& reference,
                                    const std::vector<torch::Tensor>& expected,
                                    const std::function<Holder()>& make, Step&& step) {
  std::vector<double> diffs(world, 1e9);
  runThreads(world, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Holder model = make();
    copyParams(*reference, *model);
    hddp::DistributedDataParallel ddp(model, *comm);
    step(rank, size, model, ddp);
    diffs[rank] = maxGradDiff(gradsOf(*model), expected);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_LT(diffs[r], 1e-6) << "world " << world << ", rank " << r;
  }
}

const std::function<torch::nn::Sequential()> kNet = makeNet;

// loss1.backward(); loss2.backward() without clearing: PyTorch's result is the sum of
// both batches' gradients, each reduced once (it used to be world x the first + the
// second).
TEST(DdpHardening, SecondBackwardWithoutClearingAddsEachGradientOnce) {
  for (int world : {2, 3}) {
    const int64_t B = 6 * world;
    torch::manual_seed(5);
    auto reference = makeNet();
    auto b1 = makeBatch(B, 11);
    auto b2 = makeBatch(B, 12);
    loss(reference, b1.x, b1.y).backward();
    loss(reference, b2.x, b2.y).backward();
    const auto expected = gradsOf(*reference);
    expectGradientsOfTheWholeBatch(
        world, reference, expected, kNet, [&](int rank, int size, auto& net, auto& ddp) {
          const int64_t b = B / size;  // equal shares: no setBatch needed
          auto mine1 = b1.slice(rank * b, b);
          auto mine2 = b2.slice(rank * b, b);
          loss(net, mine1.x, mine1.y).backward();
          loss(net, mine2.x, mine2.y).backward();
        });
  }
}

TEST(DdpHardening, FinalizeAfterBackwardIsANoOp) {
  const int64_t B = 8;
  torch::manual_seed(6);
  auto reference = makeNet();
  auto batch = makeBatch(B, 21);
  loss(reference, batch.x, batch.y).backward();
  const auto expected = gradsOf(*reference);
  expectGradientsOfTheWholeBatch(
      2, reference, expected, kNet, [&](int rank, int, auto& net, auto& ddp) {
        const int64_t b = rank == 0 ? 3 : 5;
        ddp.setBatch(b, B);
        auto mine = batch.slice(rank == 0 ? 0 : 3, b);
        loss(net, mine.x, mine.y).backward();
        ddp.finalize();  // documented as a no-op when the step is already synchronized
        ddp.finalize();
      });
}

// One tensor registered under two names (tied weights): PyTorch's DDP synchronizes it
// once; two hooks would weight it by (b/B)^2 and send it twice.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    w = register_parameter("w", torch::randn({5, 5}) * 0.4);
    b1 = register_parameter("b1", torch::randn({5}) * 0.1);
    b2 = register_parameter("b2", torch::randn({5}) * 0.1);
    auto head = std::make_shared<torch::nn::Module>();
    head->register_parameter("w", w);  // the same tensor, under a second name
    register_module("head", head);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::tanh(x.matmul(w.t()) + b1).matmul(w.t()) + b2;
  }
  torch::Tensor w, b1, b2;
};
TORCH_MODULE(Tied);

TEST(DdpHardening, TiedParametersAreWeightedAndSentOnce) {
  const int64_t B = 8;
  torch::manual_seed(7);
  Tied reference;
  ASSERT_EQ(reference->named_parameters().size(), 4u) << "w, b1, b2 and head.w";
  torch::manual_seed(31);
  auto x = torch::randn({B, 5});
  reference->forward(x).pow(2).mean().backward();
  const auto expected = gradsOf(*reference);
  expectGradientsOfTheWholeBatch(
      2, reference, expected, std::function<Tied()>([] { return Tied(); }),
      [&](int rank, int, auto& net, auto& ddp) {
        size_t names = 0;
        for (const auto& bucket : ddp.bucketLayout()) {
          names += bucket.size();
        }
        EXPECT_EQ(names, 3u) << "w, b1, b2: the tied weight once";
        const int64_t b = rank == 0 ? 2 : 6;
        ddp.setBatch(b, B);
        net->forward(x.narrow(0, rank == 0 ? 0 : 2, b)).pow(2).mean().backward();
      });
}

// A user with equal batches never calls setBatch; Module::load() after wrapping must
// not leave the gradients local.
TEST(DdpHardening, ModelLoadedAfterWrappingSynchronizesWithoutSetBatch) {
  std::vector<std::vector<torch::Tensor>> grads(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    torch::serialize::OutputArchive out;
    net->save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    const std::string data = bytes.str();
    torch::serialize::InputArchive in;
    in.load_from(data.data(), data.size());
    net->load(in);
    auto mine = makeBatch(4, 40 + rank);  // different data per rank
    loss(net, mine.x, mine.y).backward();
    grads[rank] = gradsOf(*net);
  });
  EXPECT_LT(maxGradDiff(grads[0], grads[1]), 1e-7) << "gradients stayed local";
}

// A model with a learned loss weight (uncertainty weighting: exp(-s) * ce + s), whose
// gradient is the loss value itself.
struct WeightedLossImpl : torch::nn::Module {
  WeightedLossImpl() {
    net = register_module("net", makeNet());
    s = register_parameter("s", torch::full({}, 0.3));
  }
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::exp(-s) * torch::cross_entropy_loss(net->forward(x), y) + s;
  }
  torch::nn::Sequential net{nullptr};
  torch::Tensor s;
};
TORCH_MODULE(WeightedLoss);

// A rank with no samples that still runs forward and backward (on an empty batch) has a
// NaN loss, and so a NaN gradient for `s`; it must contribute zeros, not NaN x 0 = NaN.
TEST(DdpHardening, EmptyBatchForwardAndBackwardContributesZeros) {
  const int64_t B = 6;
  torch::manual_seed(8);
  WeightedLoss reference;
  auto batch = makeBatch(B, 51);
  reference->loss(batch.x, batch.y).backward();
  const auto expected = gradsOf(*reference);
  expectGradientsOfTheWholeBatch(
      2, reference, expected, std::function<WeightedLoss()>([] { return WeightedLoss(); }),
      [&](int rank, int, auto& model, auto& ddp) {
        const int64_t b = rank == 0 ? B : 0;
        ddp.setBatch(b, B);
        auto mine = batch.slice(0, b);
        torch::Tensor l = model->loss(mine.x, mine.y);
        if (rank == 1) {
          EXPECT_TRUE(std::isnan(l.item<double>())) << "an empty batch's mean loss is NaN";
        }
        l.backward();
      });
}

TEST(DdpHardening, ModuleOnTwoDevicesIsAConfigErrorThatNamesBoth) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto net = std::make_shared<torch::nn::Module>();
    net->register_parameter("here", torch::zeros({3}));
    net->register_parameter("there",
                            torch::empty({3}, torch::TensorOptions().device(torch::kMeta)));
    try {
      hddp::DistributedDataParallel ddp(net, *comm);
      ADD_FAILURE() << "a module on two devices was accepted";
    } catch (const hddp::ConfigError& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("'here' is on cpu"), std::string::npos) << what;
      EXPECT_NE(what.find("'there' on meta"), std::string::npos) << what;
    }
  });
}

struct BagImpl : torch::nn::Module {
  BagImpl() {
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
    head = register_module("head", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(emb(ids).mean(1)); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Bag);

// Sparse gradients used to fail inside the hook on data_ptr(); they are now made dense
// and reduced like any other.
TEST(DdpHardening, SparseGradientsAreSynchronizedExactly) {
  const int64_t B = 8;
  torch::manual_seed(9);
  Bag reference;
  auto ids = torch::randint(0, 10, {B, 3}, torch::kLong);
  reference->forward(ids).pow(2).mean().backward();
  std::vector<torch::Tensor> expected;
  for (auto& p : reference->parameters()) {
    expected.push_back(p.grad().is_sparse() ? p.grad().to_dense() : p.grad().clone());
  }
  expectGradientsOfTheWholeBatch(
      2, reference, expected, std::function<Bag()>([] { return Bag(); }),
      [&](int rank, int, auto& net, auto& ddp) {
        const int64_t b = rank == 0 ? 3 : 5;
        ddp.setBatch(b, B);
        net->forward(ids.narrow(0, rank == 0 ? 0 : 3, b)).pow(2).mean().backward();
      });
}

// An error DDP raises at the end of backward (here: a parameter without a gradient)
// reaches the caller of backward() as an exception, in a process of its own as a user's
// program runs, and the ranks stay in lockstep.
TEST(DdpHardening, AnErrorAtTheEndOfBackwardReachesTheCaller) {
  auto outcomes = runProcesses(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto net = std::make_shared<torch::nn::Module>();
    auto used = net->register_module("used", torch::nn::Linear(4, 2));
    net->register_module("unused", torch::nn::Linear(4, 2));
    hddp::DistributedDataParallel ddp(net, *comm);
    try {
      used->forward(torch::ones({3, 4})).sum().backward();
      std::printf("no error\n");
    } catch (const hddp::Error& e) {
      std::printf("caught: %s\n", e.what_without_backtrace());
    }
    std::fflush(stdout);
    auto t = torch::ones({2});
    comm->allreduce(t).wait();
    EXPECT_TRUE(t.equal(torch::full({2}, 2.0f)));
  });
  hddp::testing::expectAllSucceeded(outcomes);
  for (const auto& o : outcomes) {
    EXPECT_NE(o.output.find("caught: "), std::string::npos)
        << "rank " << o.rank << ": " << o.output;
    EXPECT_NE(o.output.find("parameter(s) 'unused.weight'"), std::string::npos)
        << "rank " << o.rank << ": " << o.output;
  }
}

}  // namespace

// Out of memory after the step's collectives ended (here in a hook's finish, as in
// PowerSGD's decompression or a gradient's copy) cannot be answered by abandoning the
// step: the peers have their sums and have gone on, and sending the buckets again would
// pair this rank's repeat with their next step. It is a DistributedError, and
// abandonStep() says it came too late and sends nothing (the check allreduce below would
// otherwise meet a bucket's allreduce).
TEST(Ddp, OutOfMemoryAfterTheStepsCollectivesIsADistributedErrorNotAnAbandonedStep) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions c;
    c.timeout = std::chrono::seconds(60);  // a rank left behind fails the test, not hangs it
    auto comm = hddp::makeCommunicator(store, rank, size, c);
    auto net = makeNet();
    hddp::DdpOptions options;
    auto steps = std::make_shared<int>(0);
    options.commHook = [rank, steps](hddp::Communicator& c, hddp::GradBucket& bucket) {
      hddp::CommHookResult result;
      result.work = c.allreduce(bucket.buffer);
      result.finish = [rank, steps] {
        // The second step: the first's end rebuilds the buckets (a broadcast) after finish.
        TORCH_CHECK_WITH(OutOfMemoryError, ++*steps < 2 || rank != 1,
                         "test: out of memory in finish");
      };
      return result;
    };
    hddp::DistributedDataParallel ddp(net, *comm, options);
    torch::manual_seed(rank);
    ddp.setBatch(4, 8);
    net->forward(torch::randn({4, 6})).sum().backward();
    ddp.setBatch(4, 8);
    auto loss = net->forward(torch::randn({4, 6})).sum();
    if (rank == 1) {
      try {
        loss.backward();
        ADD_FAILURE() << "backward did not throw";
      } catch (const c10::OutOfMemoryError& e) {
        ADD_FAILURE() << "an out-of-memory error, which a caller answers by abandoning: "
                      << e.what_without_backtrace();
      } catch (const hddp::DistributedError& e) {
        EXPECT_NE(std::string(e.what()).find("can be neither abandoned nor repeated"),
                  std::string::npos)
            << e.what();
      }
      EXPECT_FALSE(ddp.abandonStep()) << "too late: the step's collectives ended";
    } else {
      loss.backward();
    }
    auto check = torch::full({1}, static_cast<double>(rank + 1), torch::kFloat64);
    comm->allreduce(check).wait();
    EXPECT_EQ(check.item<double>(), 3.0) << "rank " << rank;
  });
}

// Backward runs out of memory after its last gradient was sent (here in the hook of a
// tensor before the first layer, which autograd reaches after every parameter's
// gradient): abandonStep() comes too late, and says so, but finishes the step, which
// stands: this rank holds the same reduced gradients as its peer, and the next
// collective pairs (before, the step was left unfinished: the optimizer stepped on this
// rank's own gradients, and the next step's first gradient was "received twice").
TEST(Ddp, AnAbandonAfterTheLastBucketFinishesTheStepWhichStands) {
  std::vector<std::vector<torch::Tensor>> grads(2);
  runThreads(2, [&grads](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions c;
    c.timeout = std::chrono::seconds(60);  // a rank left behind fails the test, not hangs it
    auto comm = hddp::makeCommunicator(store, rank, size, c);
    auto net = makeNet();
    hddp::DistributedDataParallel ddp(net, *comm);
    torch::manual_seed(rank);
    ddp.setBatch(4, 8);
    auto x = torch::randn({4, 6}, torch::requires_grad());
    auto y = x * 1.0;  // its backward runs after every parameter's gradient
    if (rank == 1) {
      y.register_hook([](const torch::Tensor&) -> torch::Tensor {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory past the parameters");
        return {};
      });
    }
    auto loss = net->forward(y).sum();
    if (rank == 1) {
      EXPECT_THROW(loss.backward(), c10::OutOfMemoryError);
      EXPECT_FALSE(ddp.abandonStep()) << "every bucket was sent: too late";
    } else {
      loss.backward();
    }
    EXPECT_FALSE(ddp.lastStepAbandoned()) << "rank " << rank;
    grads[static_cast<size_t>(rank)] = gradsOf(*net);
    auto check = torch::full({1}, static_cast<double>(rank + 1), torch::kFloat64);
    comm->allreduce(check).wait();
    EXPECT_EQ(check.item<double>(), 3.0) << "rank " << rank;
  });
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(grads[0][i], grads[1][i])) << "gradient " << i << " differs";
  }
}
