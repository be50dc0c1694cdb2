// Collective correctness over Gloo, world sizes 1-4, several dtypes and sizes,
// in-place and coalesced, many times in a row (no cross-talk between calls).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

// Rank r's value at element i: small integers, exact in every dtype tested.
torch::Tensor rankValues(int rank, int64_t n, torch::ScalarType dtype) {
  return ((torch::arange(n, torch::kLong) % 7 + 1) * (rank + 1)).to(dtype);
}

torch::Tensor base(int64_t n, torch::ScalarType dtype) {
  return (torch::arange(n, torch::kLong) % 7 + 1).to(dtype);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllreduceBroadcastAllgatherReduceScatterAcrossDtypesAndSizes) {
  const int world = GetParam();
  runThreads(world, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    ASSERT_EQ(comm->rank(), rank);
    ASSERT_EQ(comm->size(), size);
    const double sumFactor = size * (size + 1) / 2.0;
    for (auto dtype : {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kInt64}) {
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1000), int64_t(1) << 20}) {
        SCOPED_TRACE(c10::str("rank ", rank, "/", size, " dtype ", dtype, " n ", n));
        // Sum, Max, Min
        auto t = rankValues(rank, n, dtype);
        comm->allreduce(t).wait();
        EXPECT_TRUE(t.to(torch::kDouble).equal(base(n, torch::kDouble) * sumFactor));
        t = rankValues(rank, n, dtype);
        comm->allreduce(t, {hddp::ReduceOp::Max}).wait();
        EXPECT_TRUE(t.equal(rankValues(size - 1, n, dtype)));
        t = rankValues(rank, n, dtype);
        comm->allreduce(t, {hddp::ReduceOp::Min}).wait();
        EXPECT_TRUE(t.equal(rankValues(0, n, dtype)));
        if (dtype != torch::kInt64) {
          t = rankValues(rank, n, dtype);
          comm->allreduce(t, {hddp::ReduceOp::Avg}).wait();
          EXPECT_TRUE(torch::allclose(t.to(torch::kDouble),
                                      base(n, torch::kDouble) * sumFactor / size,
                                      /*rtol=*/dtype == torch::kBFloat16 ? 1e-2 : 1e-6));
        }
        // Broadcast from the last rank.
        t = rankValues(rank, n, dtype);
        comm->broadcast(t, size - 1).wait();
        EXPECT_TRUE(t.equal(rankValues(size - 1, n, dtype)));
        if (n > 1000) {
          continue;  // allgather/reduce-scatter of the large size adds time, not coverage
        }
        // Allgather
        std::vector<torch::Tensor> outs;
        for (int r = 0; r < size; ++r) {
          outs.push_back(torch::empty({n}, dtype));
        }
        comm->allgather(outs, rankValues(rank, n, dtype)).wait();
        for (int r = 0; r < size; ++r) {
          EXPECT_TRUE(outs[r].equal(rankValues(r, n, dtype))) << "from rank " << r;
        }
        // Reduce-scatter: rank r receives the sum of everyone's slice r.
        auto input = torch::cat({rankValues(rank, n * size, dtype)}).contiguous();
        auto out = torch::empty({n}, dtype);
        comm->reduceScatter(out, input).wait();
        auto expected = (base(n * size, torch::kDouble) * sumFactor).narrow(0, rank * n, n);
        EXPECT_TRUE(out.to(torch::kDouble).equal(expected));
        // Reduce to each rank in turn: the root holds the sum.
        for (int root = 0; root < size; ++root) {
          hddp::ReduceOptions ro;
          ro.root = root;
          t = rankValues(rank, n, dtype);
          comm->reduce(t, ro).wait();
          if (rank == root) {
            EXPECT_TRUE(t.to(torch::kDouble).equal(base(n, torch::kDouble) * sumFactor))
                << "reduce to rank " << root;
          }
        }
      }
    }
    comm->barrier().wait();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(Collectives, CoalescedAllreduceOfMixedShapesRepeated) {
  runThreads(3, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    for (int iter = 0; iter < 50; ++iter) {
      std::vector<torch::Tensor> ts = {
          torch::full({3, 4}, rank + iter, torch::kFloat32),
          torch::full({0}, 1.0f),
          torch::full({1}, 2.0f * rank),
          torch::full({2, 2, 2}, float(iter)),
      };
      comm->allreduceCoalesced(ts).wait();
      const float sumRanks = size * (size - 1) / 2.0f;
      EXPECT_TRUE(ts[0].equal(torch::full({3, 4}, sumRanks + size * iter)));
      EXPECT_EQ(ts[1].numel(), 0);
      EXPECT_TRUE(ts[2].equal(torch::full({1}, 2.0f * sumRanks)));
      EXPECT_TRUE(ts[3].equal(torch::full({2, 2, 2}, float(size * iter))));
    }
  });
}

TEST(Collectives, AsyncWorkOverlapsAndCompletesInOrder) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    std::vector<torch::Tensor> ts;
    std::vector<hddp::Work> works;
    for (int i = 0; i < 20; ++i) {
      ts.push_back(torch::full({1000}, float(i + rank)));
      works.push_back(comm->allreduce(ts.back()));
    }
    for (int i = 0; i < 20; ++i) {
      works[i].wait();
      EXPECT_TRUE(works[i].isCompleted());
      EXPECT_TRUE(ts[i].equal(torch::full({1000}, float(2 * i + 1))));
    }
  });
}

// Work::onCompletion: the callback runs once the backend completed the collective
// (before or after wait() returns), and at once for work that was already complete.
TEST(Collectives, CompletionCallbackRunsOnceWhenTheCollectiveCompleted) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto calls = std::make_shared<std::atomic<int>>(0);
    torch::Tensor t = torch::full({1 << 16}, float(rank + 1));
    hddp::Work work = comm->allreduce(t);
    work.onCompletion([calls] { calls->fetch_add(1); });
    work.wait();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (calls->load() == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(calls->load(), 1);
    EXPECT_TRUE(t.equal(torch::full({1 << 16}, 3.0f)));
    hddp::Work done;  // already complete: runs at once, on this thread
    int direct = 0;
    done.onCompletion([&direct] { ++direct; });
    EXPECT_EQ(direct, 1);
  });
}

// Wait observers: told of every wait (of a Work handed out before they were added too),
// in begin/end pairs; a removed handle stops it, removing twice is harmless, and a
// handle may outlive its communicator.
TEST(Collectives, WaitObserversAreToldOfEachWaitUntilTheirHandleRemovesThem) {
  struct Counting final : hddp::WaitObserver {
    void beginWait() override { ++begun; }
    void endWait() override { ++ended; }
    int begun = 0;
    int ended = 0;
  };
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Counting first;
    Counting second;
    at::Tensor t = torch::ones({2});
    hddp::Work early = comm->allreduce(t);
    hddp::RemovableHandle a = comm->addWaitObserver(first);
    early.wait();
    EXPECT_EQ(first.begun, 1);
    EXPECT_EQ(first.ended, 1);
    hddp::RemovableHandle b = comm->addWaitObserver(second);
    comm->allreduce(t).wait();
    EXPECT_EQ(first.begun, 2);
    EXPECT_EQ(second.begun, 1);
    hddp::RemovableHandle moved = std::move(a);
    a.remove();  // moved from: removes nothing
    comm->barrier().wait();
    EXPECT_EQ(first.begun, 3);
    moved.remove();
    moved.remove();
    comm->allreduce(t).wait();
    EXPECT_EQ(first.begun, 3) << "a removed observer is not told";
    EXPECT_EQ(first.ended, 3);
    EXPECT_EQ(second.begun, 3);
    EXPECT_EQ(second.ended, 3);
    comm.reset();
    b.remove();  // after the communicator is gone: nothing to do, no crash
  });
}

TEST(Collectives, AllgatherBytesVariableSizes) {
  runThreads(4, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    for (int round = 0; round < 3; ++round) {
      std::vector<uint8_t> mine(rank * 3 + round, static_cast<uint8_t>(rank + 10 * round));
      auto all = comm->allgatherBytes(mine);
      ASSERT_EQ(static_cast<int>(all.size()), size);
      for (int r = 0; r < size; ++r) {
        EXPECT_EQ(all[r],
                  std::vector<uint8_t>(r * 3 + round, static_cast<uint8_t>(r + 10 * round)));
      }
    }
  });
}

// A fixed-size value from every rank, by rank, without packing bytes by hand.
TEST(Collectives, AllgatherValueReturnsEveryRanksValueByRank) {
  struct Report {
    double seconds;
    int64_t samples;
    bool failed;
  };
  runThreads(3, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    for (int round = 0; round < 2; ++round) {
      const Report mine{0.5 * rank + round, 100 + rank, rank == 1};
      const auto all = hddp::allgatherValue(*comm, mine);
      ASSERT_EQ(static_cast<int>(all.size()), size);
      for (int r = 0; r < size; ++r) {
        EXPECT_EQ(all[r].seconds, 0.5 * r + round);
        EXPECT_EQ(all[r].samples, 100 + r);
        EXPECT_EQ(all[r].failed, r == 1);
      }
    }
  });
}

TEST(Collectives, MisuseGivesClearErrors) {
  runThreads(1, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto nonContiguous = torch::ones({4, 4}).t();
    EXPECT_THROW(comm->allreduce(nonContiguous), hddp::Error);
    auto ints = torch::ones({4}, torch::kLong);
    EXPECT_THROW(comm->allreduce(ints, {hddp::ReduceOp::Avg}), hddp::Error);
    std::vector<torch::Tensor> mixed = {torch::ones({2}), torch::ones({2}, torch::kDouble)};
    EXPECT_THROW(comm->allreduceCoalesced(mixed), hddp::Error);
    auto t = torch::ones({2});
    EXPECT_THROW(comm->broadcast(t, 3), hddp::Error);
    std::vector<torch::Tensor> wrongCount;
    EXPECT_THROW(comm->allgather(wrongCount, t), hddp::Error);
  });
  auto store = hddp::Store::memory();
  EXPECT_THROW(hddp::makeCommunicator(store, 2, 2), hddp::ConfigError);
}

// A collective's own timeout wins over the communicator's (60 s here): rank 0's barrier,
// which rank 1 never joins, fails after about 0.3 s, naming the barrier.
TEST(Collectives, ACollectivesOwnTimeoutWinsOverTheCommunicators) {
  hddp::CommunicatorOptions opts;
  opts.timeout = std::chrono::seconds(60);
  std::atomic<bool> done{false};
  std::string error;
  double seconds = 0;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size, opts);
    if (rank == 1) {
      while (!done.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return;  // never joins the barrier
    }
    hddp::BarrierOptions o;
    o.timeout = std::chrono::milliseconds(300);
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->barrier(o).wait();
    } catch (const hddp::DistributedError& e) {
      error = e.what_without_backtrace();
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    done.store(true);
  });
  EXPECT_NE(error.find("barrier"), std::string::npos) << error;
  EXPECT_LT(seconds, 10.0) << "the call's 0.3 s timeout, not the communicator's 60 s";
  hddp::BarrierOptions negative;
  negative.timeout = std::chrono::milliseconds(-1);
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    EXPECT_THROW(comm->barrier(negative), hddp::Error);
  });
}

TEST(Collectives, MissingPeerIsATimeoutNotAHang) {
  // Two of three ranks arrive; both must get a TimeoutError within the timeout.
  hddp::CommunicatorOptions opts;
  opts.timeout = std::chrono::seconds(2);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> errors(2);
  hddp::Store store = hddp::Store::memory(std::chrono::seconds(2));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        hddp::makeCommunicator(store, r, 3, opts);
      } catch (const hddp::TimeoutError& e) {
        errors[r] = e.what_without_backtrace();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, std::chrono::seconds(30));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("timed out"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) + "/3"), std::string::npos) << errors[r];
  }
}

}  // namespace
