// The DDP engine: weighted gradients equal single-device training on the whole batch,
// for every split (zero and tiny shares included), with accumulation, unused and
// frozen parameters, compression, buffers, and real overlap of communication.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

struct MlpImpl : torch::nn::Module {
  MlpImpl(bool withSpare = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 4));
    if (withSpare) {
      spare = register_module("spare", torch::nn::Linear(16, 4));
    }
  }
  torch::Tensor forward(const torch::Tensor& x, bool useSpare = false) {
    auto h = torch::tanh(fc2(torch::tanh(fc1(x))));
    return useSpare && spare ? fc3(h) + spare(h) : fc3(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, spare{nullptr};
};
TORCH_MODULE(Mlp);

void copyParams(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    p.value().copy_(src[p.key()]);
  }
}

double maxDiff(torch::nn::Module& a, torch::nn::Module& b) {
  double d = 0;
  auto pb = b.named_parameters();
  for (auto& p : a.named_parameters()) {
    d = std::max(d, (p.value() - pb[p.key()]).abs().max().item<double>());
  }
  return d;
}

// Random split of `total` over `n` ranks, with rank n-1 given 0 and rank 0 given 1
// on alternate steps, so zero and tiny shares always occur.
std::vector<int64_t> randomSplit(int64_t total, int n, int step, std::mt19937& rng) {
  std::vector<int64_t> b(n, 0);
  int64_t left = total;
  int first = 0;
  if (n >= 3) {
    b[0] = 1;
    left -= 1;
    first = 1;
  }
  const int last = (step % 2 == 0 && n >= 2) ? n - 1 : n;  // rank n-1 gets 0 on even steps
  for (int r = first; r < last - 1; ++r) {
    std::uniform_int_distribution<int64_t> d(0, left);
    b[r] = d(rng);
    left -= b[r];
  }
  b[last - 1] += left;
  return b;
}

struct Data {
  torch::Tensor x, y;
};

Data makeData(int64_t n, int seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 8}), torch::randint(0, 4, {n}, torch::kLong)};
}

class Exactness : public ::testing::TestWithParam<int> {};

TEST_P(Exactness, WeightedDdpEqualsSingleDeviceTrainingForAnySplit) {
  const int world = GetParam();
  const int64_t B = 24;
  const int steps = 6;
  torch::manual_seed(1);
  Mlp reference;
  Mlp initial;
  copyParams(*reference, *initial);
  std::vector<Data> data;
  for (int s = 0; s < steps; ++s) {
    data.push_back(makeData(B, 100 + s));
  }
  {
    torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      torch::cross_entropy_loss(reference->forward(data[s].x), data[s].y).backward();
      opt.step();
    }
  }
  std::mt19937 rng(7);
  std::vector<std::vector<int64_t>> splits;
  for (int s = 0; s < steps; ++s) {
    splits.push_back(randomSplit(B, world, s, rng));
  }
  std::vector<double> diffs(world, 1e9);
  runThreads(world, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model;  // random init differs per rank: construction must broadcast rank 0's
    if (rank == 0) {
      copyParams(*initial, *model);
    }
    hddp::DdpOptions opts;
    opts.firstBucketBytes = 512;  // several buckets even for this small model
    opts.bucketCapBytes = 1024;
    hddp::DistributedDataParallel ddp(model, *comm, opts);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int s = 0; s < steps; ++s) {
      const auto& split = splits[s];
      int64_t start = 0;
      for (int r = 0; r < rank; ++r) {
        start += split[r];
      }
      const int64_t b = split[rank];
      ddp.setBatch(b, B);
      opt.zero_grad();
      if (b > 0) {
        auto x = data[s].x.narrow(0, start, b);
        auto y = data[s].y.narrow(0, start, b);
        torch::cross_entropy_loss(model->forward(x), y).backward();
      } else {
        ddp.finalize();  // no samples this step: contribute zeros
      }
      opt.step();
    }
    diffs[rank] = maxDiff(*model, *reference);
  });
  for (int r = 0; r < world; ++r) {
    // float32: the weighted sum reorders additions of ~1e-2-sized terms; 6 steps of
    // SGD with momentum keep the rounding difference near 1e-7, far below 1e-5.
    EXPECT_LT(diffs[r], 1e-5) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Exactness, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(Ddp, NoSyncAccumulationEqualsOneBigBatch) {
  const int64_t B = 20;
  torch::manual_seed(3);
  Mlp reference;
  Mlp initial;
  copyParams(*reference, *initial);
  auto d = makeData(B, 11);
  torch::cross_entropy_loss(reference->forward(d.x), d.y).backward();
  // Rank 0 takes samples [0, 3) then [3, 9); rank 1 takes [9, 11) then [11, 20).
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> micro = {{{0, 3}, {3, 6}},
                                                                       {{9, 2}, {11, 9}}};
  std::vector<double> diffs(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model;
    copyParams(*initial, *model);
    hddp::DistributedDataParallel ddp(model, *comm);
    const auto& m = micro[rank];
    {
      auto guard = ddp.noSync();
      ddp.setBatch(m[0].second, B);
      torch::cross_entropy_loss(model->forward(d.x.narrow(0, m[0].first, m[0].second)),
                                d.y.narrow(0, m[0].first, m[0].second))
          .backward();
      EXPECT_EQ(ddp.lastStepStats().buckets, 0) << "no communication inside noSync";
    }
    ddp.setBatch(m[1].second, B);
    torch::cross_entropy_loss(model->forward(d.x.narrow(0, m[1].first, m[1].second)),
                              d.y.narrow(0, m[1].first, m[1].second))
        .backward();
    double diff = 0;
    auto ref = reference->named_parameters();
    for (auto& p : model->named_parameters()) {
      diff = std::max(diff, (p.value().grad() - ref[p.key()].grad()).abs().max().item<double>());
    }
    diffs[rank] = diff;
  });
  EXPECT_LT(diffs[0], 1e-6);
  EXPECT_LT(diffs[1], 1e-6);
}

TEST(Ddp, MismatchedModelsAreAClearErrorOnEveryRank) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    std::shared_ptr<torch::nn::Module> model;
    if (rank == 0) {
      model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 2)).ptr();
    } else {
      model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 3)).ptr();
    }
    try {
      hddp::DistributedDataParallel ddp(model, *comm);
    } catch (const hddp::ConfigError& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("differs between rank 0 and rank 1"), std::string::npos) << e;
    EXPECT_NE(e.find("1.weight"), std::string::npos) << e;
  }
}

TEST(Ddp, UnusedParametersErrorNamesThemWithoutHanging) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model(/*withSpare=*/true);
    hddp::DistributedDataParallel ddp(model, *comm);
    auto d = makeData(4, 5);
    try {
      torch::cross_entropy_loss(model->forward(d.x), d.y).backward();
    } catch (const hddp::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
    // The group is still in lockstep: a collective after the error completes.
    auto t = torch::ones({3});
    comm->allreduce(t).wait();
    EXPECT_TRUE(t.equal(torch::full({3}, 2.0f)));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("'spare.weight'"), std::string::npos) << e;
    EXPECT_NE(e.find("findUnusedParameters"), std::string::npos) << e;
  }
}

TEST(Ddp, UnusedOnSomeRanksIsExactWithFindUnusedParameters) {
  const int64_t B = 8;
  torch::manual_seed(4);
  Mlp reference(true);
  Mlp initial(true);
  copyParams(*reference, *initial);
  auto d = makeData(B, 9);
  // Samples [0,4) use the spare head (rank 0), samples [4,8) do not (rank 1).
  auto l0 = torch::cross_entropy_loss(reference->forward(d.x.narrow(0, 0, 4), true),
                                      d.y.narrow(0, 0, 4), {}, torch::Reduction::Sum);
  auto l1 = torch::cross_entropy_loss(reference->forward(d.x.narrow(0, 4, 4), false),
                                      d.y.narrow(0, 4, 4), {}, torch::Reduction::Sum);
  ((l0 + l1) / B).backward();
  std::vector<double> diffs(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model(true);
    copyParams(*initial, *model);
    hddp::DdpOptions opts;
    opts.findUnusedParameters = true;
    hddp::DistributedDataParallel ddp(model, *comm, opts);
    ddp.setBatch(4, B);
    torch::cross_entropy_loss(model->forward(d.x.narrow(0, 4 * rank, 4), rank == 0),
                              d.y.narrow(0, 4 * rank, 4))
        .backward();
    EXPECT_EQ(ddp.lastStepStats().unusedParameters, rank == 0 ? 0 : 2);
    double diff = 0;
    auto ref = reference->named_parameters();
    for (auto& p : model->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      diff = std::max(diff, (p.value().grad() - ref[p.key()].grad()).abs().max().item<double>());
    }
    diffs[rank] = diff;
  });
  EXPECT_LT(diffs[0], 1e-6);
  EXPECT_LT(diffs[1], 1e-6);
}

struct ManySmallOneHugeImpl : torch::nn::Module {
  ManySmallOneHugeImpl() {
    for (int i = 0; i < 40; ++i) {
      small.push_back(register_parameter("small" + std::to_string(i), torch::randn({3})));
    }
    huge = register_parameter("huge", torch::randn({8 << 20}));  // 32 MiB, above the cap
    frozen = register_parameter("frozen", torch::randn({5}), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto s = huge.narrow(0, 0, 4).sum() * x.sum() + frozen.sum();
    for (auto& p : small) {
      s = s + (p * x.mean()).sum();
    }
    return s + huge.pow(2).mean();
  }
  std::vector<torch::Tensor> small;
  torch::Tensor huge, frozen;
};
TORCH_MODULE(ManySmallOneHuge);

TEST(Ddp, BucketsOfManySmallAndOneHugeParameterAndFrozenOnes) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(rank + 20);
    ManySmallOneHuge model;
    hddp::DistributedDataParallel ddp(model, *comm);
    // Frozen parameters are broadcast but not bucketed.
    auto frozen = model->frozen.clone();
    comm->broadcast(frozen, 0).wait();
    EXPECT_TRUE(model->frozen.equal(frozen));
    auto layout = ddp.bucketLayout();
    int withHuge = -1;
    size_t names = 0;
    for (size_t b = 0; b < layout.size(); ++b) {
      names += layout[b].size();
      for (const auto& n : layout[b]) {
        EXPECT_NE(n, "frozen");
        if (n == "huge") {
          withHuge = static_cast<int>(b);
        }
      }
    }
    EXPECT_EQ(names, 41u);
    ASSERT_GE(withHuge, 0);
    ddp.setBatch(rank == 0 ? 1 : 3, 4);
    auto x = torch::full({2}, float(rank + 1));
    model->forward(x).backward();
    // Expected: 1/4 * grad(rank 0's input) + 3/4 * grad(rank 1's input).
    // d/dp of (p * x.mean()).sum() is x.mean() = rank + 1.
    auto expectedSmall = torch::full({3}, 0.25f * 1.0f + 0.75f * 2.0f);
    EXPECT_TRUE(torch::allclose(model->small[7].grad(), expectedSmall)) << model->small[7].grad();
    EXPECT_FALSE(model->frozen.grad().defined());
  });
}

TEST(Ddp, OverlapLaunchesBucketsBeforeBackwardEnds) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model;
    hddp::DdpOptions opts;
    opts.firstBucketBytes = 256;
    opts.bucketCapBytes = 256;
    hddp::DistributedDataParallel ddp(model, *comm, opts);
    auto d = makeData(8, 1);
    for (int i = 0; i < 3; ++i) {
      torch::cross_entropy_loss(model->forward(d.x), d.y).backward();
      const auto& st = ddp.lastStepStats();
      EXPECT_GE(st.buckets, 3);
      EXPECT_GE(st.bucketsLaunchedDuringBackward, 1)
          << "no bucket was launched while gradients were still being computed";
      EXPECT_LT(st.bucketsLaunchedDuringBackward, st.buckets);
    }
  });
}

// A user's communication hook sees every bucket, in index order on every rank, and its
// `finish` writes back what it reduced: here a float64 copy, which must give the plain
// allreduce's gradients. Setting both a hook and compression is refused.
TEST(Ddp, CommHookSeesEveryBucketInOrderAndItsResultIsUsed) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(2);
    Mlp plain;
    Mlp hooked;
    copyParams(*plain, *hooked);
    std::vector<int> seen;
    std::vector<bool> last;
    hddp::DdpOptions opts;
    opts.firstBucketBytes = 256;
    opts.bucketCapBytes = 1024;
    opts.commHook = [&seen, &last](hddp::Communicator& c, hddp::GradBucket& bucket) {
      seen.push_back(bucket.index);
      last.push_back(bucket.isLast);
      // The contract: the buffer holds the parameters' gradients, each at its offset,
      // and nothing else (DDP's status travels outside it).
      EXPECT_EQ(bucket.parameters.size(), bucket.offsets.size());
      int64_t at = 0;
      const auto grads = bucket.gradients();
      for (size_t i = 0; i < bucket.parameters.size(); ++i) {
        EXPECT_EQ(bucket.offsets[i], at);
        EXPECT_EQ(grads[i].sizes(), bucket.parameters[i].sizes());
        EXPECT_EQ(grads[i].data_ptr<float>(), bucket.buffer.data_ptr<float>() + at);
        at += bucket.parameters[i].numel();
      }
      EXPECT_EQ(bucket.buffer.numel(), at) << "bucket " << bucket.index;
      at::Tensor wide = bucket.buffer.to(at::kDouble);
      at::Tensor buffer = bucket.buffer;
      hddp::Work work = c.allreduce(wide);
      return hddp::CommHookResult{std::move(work),
                                  [buffer, wide]() mutable { buffer.copy_(wide); }};
    };
    hddp::DdpOptions plainOpts;
    plainOpts.firstBucketBytes = 256;
    plainOpts.bucketCapBytes = 1024;
    hddp::DistributedDataParallel a(plain, *comm, plainOpts);
    hddp::DistributedDataParallel b(hooked, *comm, opts);
    auto d = makeData(8, 40 + rank);
    torch::cross_entropy_loss(plain->forward(d.x), d.y).backward();
    torch::cross_entropy_loss(hooked->forward(d.x), d.y).backward();
    const int buckets = b.lastStepStats().buckets;
    ASSERT_GE(buckets, 2);
    std::vector<int> expected(static_cast<size_t>(buckets));
    std::iota(expected.begin(), expected.end(), 0);
    EXPECT_EQ(seen, expected);
    std::vector<bool> lastOnly(static_cast<size_t>(buckets), false);
    lastOnly.back() = true;
    EXPECT_EQ(last, lastOnly);
    auto pa = plain->named_parameters();
    for (auto& p : hooked->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value().grad(), pa[p.key()].grad(), 1e-6, 1e-7)) << p.key();
    }
    hddp::DdpOptions both = opts;
    both.compression = hddp::GradCompression::Bf16;
    Mlp other;
    EXPECT_THROW(hddp::DistributedDataParallel(other, *comm, both), hddp::ConfigError);
    // Auto is the Trainer's to resolve: DDP alone refuses it, saying so.
    hddp::DdpOptions automatic;
    automatic.compression = hddp::GradCompression::Auto;
    try {
      hddp::DistributedDataParallel(other, *comm, automatic);
      ADD_FAILURE() << "Auto was accepted";
    } catch (const hddp::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("chooseCompression"), std::string::npos) << e.what();
    }
  });
}

TEST(Ddp, CompressionIsCloseToExact) {
  for (auto mode : {hddp::GradCompression::Fp16, hddp::GradCompression::Bf16}) {
    std::vector<double> diffs(2);
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      torch::manual_seed(2);
      Mlp plain;
      Mlp compressed;
      copyParams(*plain, *compressed);
      hddp::DdpOptions opts;
      opts.compression = mode;
      hddp::DistributedDataParallel a(plain, *comm);
      hddp::DistributedDataParallel b(compressed, *comm, opts);
      auto d = makeData(8, 30 + rank);
      torch::cross_entropy_loss(plain->forward(d.x), d.y).backward();
      torch::cross_entropy_loss(compressed->forward(d.x), d.y).backward();
      double rel = 0;
      auto pa = plain->named_parameters();
      for (auto& p : compressed->named_parameters()) {
        auto ref = pa[p.key()].grad();
        rel = std::max(
            rel, ((p.value().grad() - ref).abs().max() / (ref.abs().max() + 1e-12)).item<double>());
      }
      diffs[rank] = rel;
    });
    const double bound = mode == hddp::GradCompression::Fp16 ? 2e-3 : 1.6e-2;
    EXPECT_LT(diffs[0], bound);
    EXPECT_GT(diffs[0], 0.0) << "compression changed nothing: was it applied?";
  }
}

// BatchNorm's running statistics come from the ranks that computed them, weighted by
// their samples: a rank with no samples (whose statistics never moved) sets nothing,
// and a tiny share on rank 0 sets only its part. The running mean then equals
// single-device training's on the whole batch; with one rank holding every sample,
// the running variance does too. (Rank 0's broadcast gave the zero-share rank's
// initial statistics to everyone.)
class BufferStatistics : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(BufferStatistics, ComeFromTheRanksThatTrainedWeightedBySamples) {
  const std::vector<int64_t> split = GetParam();
  const int size = static_cast<int>(split.size());
  const int64_t B = std::accumulate(split.begin(), split.end(), int64_t{0});
  torch::manual_seed(7);
  // Rank 0's samples differ from the rest in mean and spread: wrong weights show.
  auto x = torch::randn({B, 4});
  x.narrow(0, 0, split[0]).mul_(5).add_(3);
  auto makeModel = [] {
    return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6),
                                 torch::nn::Linear(6, 2));
  };
  torch::manual_seed(3);
  auto initial = makeModel();
  auto single = makeModel();
  copyParams(*initial, *single);
  const int steps = 3;
  for (int s = 0; s < steps; ++s) {
    single->forward(x).sum().backward();
  }
  const auto want = single[1]->named_buffers();
  runThreads(size, [&](int rank, int n, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, n);
    auto model = makeModel();  // the threads draw from one generator: copy the weights
    copyParams(*initial, *model);
    hddp::DistributedDataParallel ddp(model, *comm);
    int64_t offset = 0;
    for (int r = 0; r < rank; ++r) {
      offset += split[r];
    }
    for (int s = 0; s < steps; ++s) {
      model->zero_grad();
      ddp.setBatch(split[rank], B);
      if (split[rank] == 0) {
        ddp.finalize();
      } else {
        model->forward(x.narrow(0, offset, split[rank])).mean().backward();
      }
    }
    const auto got = model[1]->named_buffers();
    EXPECT_TRUE(torch::allclose(got["running_mean"], want["running_mean"], 1e-5, 1e-6))
        << "rank " << rank << ": " << got["running_mean"] << " vs " << want["running_mean"];
    if (std::count_if(split.begin(), split.end(), [](int64_t b) { return b > 0; }) == 1) {
      EXPECT_TRUE(torch::allclose(got["running_var"], want["running_var"], 1e-5, 1e-6))
          << "rank " << rank << ": " << got["running_var"] << " vs " << want["running_var"];
    }
    EXPECT_EQ(got["num_batches_tracked"].item<int64_t>(), steps) << "rank " << rank;
  });
}

INSTANTIATE_TEST_SUITE_P(Splits, BufferStatistics,
                         ::testing::Values(std::vector<int64_t>{0, 128},
                                           std::vector<int64_t>{2, 126},
                                           std::vector<int64_t>{64, 64},
                                           std::vector<int64_t>{0, 40, 88}));

// Throws c10::OutOfMemoryError in backward when `fail` is set, as a card out of memory
// halfway through backward does.
struct OomInBackward : torch::autograd::Function<OomInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               bool fail) {
    ctx->saved_data["fail"] = fail;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK_WITH(OutOfMemoryError, !ctx->saved_data["fail"].toBool(),
                     "test: out of memory in backward");
    return {grads[0], torch::Tensor()};
  }
};

// A hook that reduces each parameter's gradient on its own (through the bucket's
// gradients()), as a hook that compresses per tensor does: it never touches anything
// in the bucket beyond the gradients, so DDP's status must travel outside it.
hddp::CommHook perParameterHook() {
  return [](hddp::Communicator& comm, hddp::GradBucket& bucket) {
    std::vector<at::Tensor> grads = bucket.gradients();
    return hddp::CommHookResult{comm.allreduceCoalesced(grads), nullptr, nullptr};
  };
}

// A rank that runs out of memory in forward or halfway through backward abandons the
// step: every rank completes the step's collectives, every rank sees the step as
// abandoned, and the repeated step under another split is exact. Also with a user's
// hook that reduces the gradients only (the status then has an allreduce of its own).
class Abandon : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(Abandon, EveryRankSeesItAndTheRepeatedStepIsExact) {
  const int world = std::get<0>(GetParam());
  const bool inBackward = std::get<1>(GetParam());
  const bool userHook = std::get<2>(GetParam());
  const int64_t B = 12;
  torch::manual_seed(3);
  Mlp reference;
  Mlp initial;
  copyParams(*reference, *initial);
  const Data data = makeData(B, 42);
  {
    torch::optim::SGD opt(reference->parameters(), torch::optim::SGDOptions(0.1));
    opt.zero_grad();
    torch::cross_entropy_loss(reference->forward(data.x), data.y).backward();
    opt.step();
  }
  std::vector<int> abandoned(world, -1);
  std::vector<int> abandonedAfterRetry(world, -1);
  std::vector<double> diffs(world, 1e9);
  runThreads(world, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model;
    if (rank == 0) {
      copyParams(*initial, *model);
    }
    hddp::DdpOptions opts;
    opts.firstBucketBytes = 256;  // fc3's gradients are sent before fc2's backward
    opts.bucketCapBytes = 512;
    if (userHook) {
      opts.commHook = perParameterHook();
    }
    hddp::DistributedDataParallel ddp(model, *comm, opts);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto run = [&](const std::vector<int64_t>& split, int failing) {
      int64_t start = 0;
      for (int r = 0; r < rank; ++r) {
        start += split[r];
      }
      ddp.setBatch(split[rank], B);
      opt.zero_grad();
      auto x = data.x.narrow(0, start, split[rank]);
      auto y = data.y.narrow(0, start, split[rank]);
      try {
        if (rank == failing && !inBackward) {
          TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory in forward");
        }
        auto h = torch::tanh(model->fc2(torch::tanh(model->fc1(x))));
        h = OomInBackward::apply(h, rank == failing);
        torch::cross_entropy_loss(model->fc3(h), y).backward();
      } catch (const c10::OutOfMemoryError&) {
        EXPECT_EQ(rank, failing);
        EXPECT_TRUE(ddp.abandonStep());
      }
      const bool gone = ddp.lastStepAbandoned();
      if (!gone) {
        opt.step();
      }
      return gone;
    };
    std::vector<int64_t> first(world, B / world);
    abandoned[rank] = run(first, 1) ? 1 : 0;
    std::vector<int64_t> second(world, 0);
    second[0] = B - 2 * (world - 1);
    for (int r = 1; r < world; ++r) {
      second[r] = 2;  // the failing rank (1) gets less
    }
    abandonedAfterRetry[rank] = run(second, -1) ? 1 : 0;
    diffs[rank] = maxDiff(*model, *reference);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(abandoned[r], 1) << "rank " << r << " did not see the abandoned step";
    EXPECT_EQ(abandonedAfterRetry[r], 0) << "rank " << r;
    EXPECT_LT(diffs[r], 1e-5) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WhereAndWorld, Abandon,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_backward" : "_forward") +
                                  (std::get<2>(info.param) ? "_userHook" : "");
                         });

// A hook that throws when the last bucket is launched on one rank (out of memory on the
// autograd thread): that rank abandons the step, DDP sends the bucket at the step's end
// (the other rank waits for it), and every rank sees the step abandoned, with no hang.
TEST(Ddp, ABucketWhoseHookThrewIsSentAtTheStepsEndAndNoRankHangs) {
  std::vector<int> abandoned(2, -1);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(20);
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    torch::manual_seed(2);
    Mlp model;
    hddp::DdpOptions opts;
    opts.firstBucketBytes = 256;
    opts.bucketCapBytes = 1024;
    auto throwOnce = std::make_shared<bool>(rank == 1);
    opts.commHook = [throwOnce](hddp::Communicator& c, hddp::GradBucket& bucket) {
      if (bucket.isLast && *throwOnce) {
        *throwOnce = false;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory in the hook");
      }
      return hddp::CommHookResult{c.allreduce(bucket.buffer), nullptr, nullptr};
    };
    hddp::DistributedDataParallel ddp(model, *comm, opts);
    auto d = makeData(8, 50 + rank);
    ddp.setBatch(8, 16);
    try {
      torch::cross_entropy_loss(model->forward(d.x), d.y).backward();
      EXPECT_EQ(rank, 0);
    } catch (const std::exception& e) {
      EXPECT_EQ(rank, 1) << e.what();
      EXPECT_TRUE(ddp.abandonStep());
    }
    abandoned[rank] = ddp.lastStepAbandoned() ? 1 : 0;
  });
  EXPECT_EQ(abandoned, (std::vector<int>{1, 1}));
}

TEST(Ddp, BadBatchSizesAreRejected) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model;
    hddp::DistributedDataParallel ddp(model, *comm);
    EXPECT_THROW(ddp.setBatch(5, 4), hddp::Error);
    EXPECT_THROW(ddp.setBatch(-1, 4), hddp::Error);
    EXPECT_THROW(ddp.setBatch(0, 0), hddp::Error);
  });
}

}  // namespace

// Module::load() replaces each parameter's gradient accumulator (it calls set_): the
// engine must notice and attach its hooks again, or gradients would silently stay local.
TEST(Ddp, ParametersLoadedAfterConstructionStillSynchronize) {
  std::vector<std::vector<at::Tensor>> grads(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Mlp model;
    hddp::DistributedDataParallel ddp(model, *comm);
    torch::serialize::OutputArchive out;
    model->save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    const std::string data = bytes.str();
    torch::serialize::InputArchive in;
    in.load_from(data.data(), data.size());
    model->load(in);  // set_() on every parameter
    torch::manual_seed(10 + rank);
    auto x = torch::randn({4, 8});
    ddp.setBatch(4, 8);
    torch::nn::functional::mse_loss(model->forward(x), torch::zeros({4, 4})).backward();
    for (const auto& p : model->parameters()) {
      grads[rank].push_back(p.grad().clone());
    }
  });
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(at::allclose(grads[0][i], grads[1][i])) << "parameter " << i << " not synchronized";
  }
}
