// hddp/comm/exchange.h: several numbers reduced in one collective, a root's bytes to every
// rank, and "run on some ranks, make the outcome or the error everyone's" with fixed-size
// records. Ranks are threads over an in-memory store; a counting communicator checks how
// many collectives each call runs (every rank the same number, on every path).
#include "hddp/comm/exchange.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

// Forwards to a real communicator and counts the collectives launched through it.
class Counting final : public hddp::Communicator {
 public:
  explicit Counting(std::unique_ptr<hddp::Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  hddp::Backend backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  c10::Device device() const override { return inner_->device(); }
  using hddp::Communicator::allreduce;
  using hddp::Communicator::broadcast;
  using hddp::Communicator::reduceScatter;
  hddp::Work allreduce(at::Tensor& tensor, const hddp::AllreduceOptions& options) override {
    ++launched;
    return inner_->allreduce(tensor, options);
  }
  hddp::Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                                const hddp::AllreduceOptions& options) override {
    ++launched;
    return inner_->allreduceCoalesced(tensors, options);
  }
  hddp::Work broadcast(at::Tensor& tensor, const hddp::BroadcastOptions& options) override {
    ++launched;
    return inner_->broadcast(tensor, options);
  }
  hddp::Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                       const hddp::AllgatherOptions& options) override {
    ++launched;
    return inner_->allgather(outputs, input, options);
  }
  hddp::Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                           const hddp::ReduceScatterOptions& options) override {
    ++launched;
    return inner_->reduceScatter(output, input, options);
  }
  hddp::Work barrier(const hddp::BarrierOptions& options) override {
    ++launched;
    return inner_->barrier(options);
  }
  int launched = 0;

 private:
  std::unique_ptr<hddp::Communicator> inner_;
};

Counting counting(hddp::Store& store, int rank, int size) {
  return Counting(hddp::makeCommunicator(store, rank, size));
}

TEST(Exchange, ReduceValuesReducesSeveralNumbersInOneCollective) {
  for (int world : {1, 3}) {
    runThreads(world, [](int rank, int size, hddp::Store& store) {
      Counting comm = counting(store, rank, size);
      const double r = rank;
      const auto sum = hddp::reduceValues(comm, std::array<double, 3>{r, 1.0, 0.5 * r});
      EXPECT_EQ(comm.launched, 1);
      EXPECT_EQ(sum[0], size * (size - 1) / 2.0);
      EXPECT_EQ(sum[1], size);
      EXPECT_EQ(sum[2], size * (size - 1) / 4.0);
      const auto max = hddp::reduceValues(comm, std::vector<double>{r, -r}, hddp::ReduceOp::Max);
      const auto min = hddp::reduceValues(comm, std::vector<double>{r, -r}, hddp::ReduceOp::Min);
      EXPECT_EQ(comm.launched, 3);
      EXPECT_EQ(max, (std::vector<double>{size - 1.0, 0.0}));
      EXPECT_EQ(min, (std::vector<double>{0.0, 1.0 - size}));
      // Integers up to 2^53 come back exactly (steps and sample counts travel as doubles).
      const double big = 9007199254740991.0;  // 2^53 - 1
      EXPECT_EQ(hddp::reduceValues(comm, std::array<double, 1>{rank == 0 ? big : 0.0},
                                   hddp::ReduceOp::Max)[0],
                big);
      // Misuse fails before any collective, on every rank alike.
      EXPECT_THROW(hddp::reduceValues(comm, std::vector<double>{}), hddp::Error);
      EXPECT_EQ(comm.launched, 4);
    });
  }
}

TEST(Exchange, BroadcastBytesSendsEmptyAndLargePayloadsFromAnyRoot) {
  runThreads(3, [](int rank, int size, hddp::Store& store) {
    Counting comm = counting(store, rank, size);
    // Large, with every byte value (zeros included: no text handling), from rank 2.
    std::string large(5 * 1000 * 1000 + 3, '\0');
    for (size_t i = 0; i < large.size(); ++i) {
      large[i] = static_cast<char>((i * 131 + 7) % 256);
    }
    const std::string got = hddp::broadcastBytes(comm, 2, rank == 2 ? large : "ignored");
    EXPECT_EQ(got.size(), large.size());
    EXPECT_TRUE(got == large);
    EXPECT_EQ(comm.launched, 2);
    // Empty: every rank gets an empty string, in the same two collectives.
    EXPECT_EQ(hddp::broadcastBytes(comm, 0, rank == 0 ? "" : "not this"), "");
    EXPECT_EQ(comm.launched, 4);
    EXPECT_EQ(hddp::broadcastBytes(comm, 1, rank == 1 ? "one" : ""), "one");
    EXPECT_THROW(hddp::broadcastBytes(comm, size, "x"), hddp::Error);
    EXPECT_EQ(comm.launched, 6);
  });
}

struct Scan {
  int64_t step;
  uint64_t id;
  int32_t refused;
  int32_t pad;  // no padding travels unset
};

TEST(Exchange, RunAndShareResultGivesEveryRankEachRanksRecordAndFailure) {
  runThreads(3, [](int rank, int size, hddp::Store& store) {
    Counting comm = counting(store, rank, size);
    // Ranks 0 and 2 run; rank 2 fails after it filled in part of its record.
    const auto all = hddp::runAndShareResult<Scan>(comm, rank != 1, [&](Scan& mine) {
      mine.refused = 10 + rank;
      HDDP_CHECK_AS(hddp::StateError, rank != 2, "folder of rank ", rank, " unreadable");
      mine.step = 1000 + rank;
      mine.id = 0xFFFFFFFFFFFFFF00ull + static_cast<uint64_t>(rank);
    });
    EXPECT_EQ(comm.launched, 2);
    ASSERT_EQ(static_cast<int>(all.size()), size);
    EXPECT_FALSE(all[0].failed());
    EXPECT_EQ(all[0].value.step, 1000);
    EXPECT_EQ(all[0].value.id, 0xFFFFFFFFFFFFFF00ull);
    EXPECT_EQ(all[0].value.refused, 10);
    EXPECT_FALSE(all[1].failed());  // did not run: its record is the default
    EXPECT_EQ(all[1].value.step, 0);
    EXPECT_EQ(all[1].value.refused, 0);
    EXPECT_EQ(all[2].failure, hddp::FailureKind::State);
    EXPECT_EQ(all[2].value.refused, 12);
    EXPECT_NE(all[2].message.find("folder of rank 2 unreadable"), std::string::npos);
    EXPECT_EQ(hddp::firstFailed(all), 2);
  });
}

TEST(Exchange, RunAndShareOutcomeIsOneCollectiveWhenAllSucceedAndKeepsEachFailuresKind) {
  runThreads(4, [](int rank, int size, hddp::Store& store) {
    Counting comm = counting(store, rank, size);
    auto none = hddp::runAndShareOutcome(comm, true, [] {});
    EXPECT_EQ(comm.launched, 1);
    EXPECT_EQ(hddp::firstFailed(none), -1);
    // Each kind of failure, one a rank: the kind says what it was, not the message.
    const auto all = hddp::runAndShareOutcome(comm, true, [&] {
      switch (rank) {
        case 0:
          throw std::bad_alloc();
        case 1:
          HDDP_THROW(hddp::ConfigError, "bad option");
        case 2:
          throw std::runtime_error("plain");
        default:
          break;
      }
    });
    EXPECT_EQ(comm.launched, 3);
    EXPECT_EQ(all[0].failure, hddp::FailureKind::OutOfMemory);
    EXPECT_EQ(all[1].failure, hddp::FailureKind::Config);
    EXPECT_NE(all[1].message.find("bad option"), std::string::npos);
    EXPECT_EQ(all[1].message.find("Exception raised from"), std::string::npos);  // no backtrace
    EXPECT_EQ(all[2].failure, hddp::FailureKind::Foreign);
    EXPECT_EQ(all[2].message, "plain");
    EXPECT_FALSE(all[3].failed());
    EXPECT_EQ(hddp::firstFailed(all), 0);
    // A rank's kind becomes the same type on every rank.
    EXPECT_THROW(hddp::throwAs(all[1].failure, all[1].message), hddp::ConfigError);
    EXPECT_THROW(hddp::throwAs(hddp::FailureKind::State, "x"), hddp::StateError);
    EXPECT_THROW(hddp::throwAs(hddp::FailureKind::Data, "x"), hddp::DataError);
    EXPECT_THROW(hddp::throwAs(hddp::FailureKind::Distributed, "x"), hddp::DistributedError);
    try {  // another rank's out of memory is not this rank's
      hddp::throwAs(all[0].failure, all[0].message);
      ADD_FAILURE() << "throwAs returned";
    } catch (const c10::OutOfMemoryError&) {
      ADD_FAILURE() << "another rank's out of memory thrown as this rank's";
    } catch (const hddp::Error&) {
    }
  });
}

TEST(Exchange, AgreeOutcomeMakesOneRanksErrorEveryRanksOfTheSameTypeNamingTheRank) {
  for (int failing : {0, 2}) {
    runThreads(3, [failing](int rank, int size, hddp::Store& store) {
      Counting comm = counting(store, rank, size);
      try {
        hddp::agreeOutcome<hddp::StateError>(comm, "reading the commit", [&] {
          HDDP_CHECK_AS(hddp::StateError, rank != failing, "disk full on rank ", rank);
        });
        ADD_FAILURE() << "rank " << rank << " did not throw";
      } catch (const hddp::StateError& e) {
        const std::string text = e.what_without_backtrace();
        EXPECT_NE(text.find(c10::str("disk full on rank ", failing)), std::string::npos) << text;
        if (rank != failing) {
          EXPECT_NE(text.find(c10::str("reading the commit failed on rank ", failing)),
                    std::string::npos)
              << text;
        }
      }
      EXPECT_EQ(comm.launched, 2);
      // And where every rank succeeds: one collective, nothing thrown.
      hddp::agreeOutcome(comm, "nothing", [] {});
      EXPECT_EQ(comm.launched, 3);
      (void)size;
    });
  }
}

TEST(Exchange, AgreeAllAndAgreeAnyAreTheSameEverywhere) {
  runThreads(3, [](int rank, int size, hddp::Store& store) {
    Counting comm = counting(store, rank, size);
    EXPECT_FALSE(hddp::agreeAll(comm, rank != 1));
    EXPECT_TRUE(hddp::agreeAny(comm, rank == 1));
    EXPECT_TRUE(hddp::agreeAll(comm, true));
    EXPECT_FALSE(hddp::agreeAny(comm, false));
    (void)size;
  });
}

TEST(Exchange, OutcomesFromAnotherBuildAreRefusedNamingTheRank) {
  runThreads(2, [](int rank, int size, hddp::Store& store) {
    Counting comm = counting(store, rank, size);
    // Rank 1 sends a kind no build knows: every rank refuses it.
    const std::vector<uint8_t> said =
        rank == 1 ? std::vector<uint8_t>{200, 'x'} : std::vector<uint8_t>{};
    const auto all = comm.allgatherBytes(said);
    int32_t value = 0;
    EXPECT_NO_THROW(hddp::detail::unpackResult(all[0].empty() ? std::vector<uint8_t>{0} : all[0], 0,
                                               nullptr, 0));
    try {
      hddp::detail::unpackResult(all[1], 1, &value, 0);
      ADD_FAILURE() << "an unknown kind was taken";
    } catch (const hddp::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("rank 1 sent"), std::string::npos);
    }
    // A record shorter than its value.
    EXPECT_THROW(hddp::detail::unpackResult({0, 1, 2}, 1, &value, sizeof(value)), hddp::Error);
    (void)size;
  });
}

// LibTorch's CPU allocator reports a failed allocation as a plain c10::Error: it is out
// of memory all the same, so a state file's reader does not call a good file damaged
// (and the commit folders do not pass over the newest commit for an older one).
TEST(Exchange, LibTorchsFailedHostAllocationIsOutOfMemory) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer ends the process at an allocation of a petabyte";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "AddressSanitizer ends the process at an allocation of a petabyte";
#endif
#endif
  hddp::RankOutcome said;
  try {
    at::empty({int64_t{1} << 50}, at::kByte);  // a petabyte: posix_memalign says ENOMEM
    FAIL() << "a petabyte was allocated";
  } catch (...) {
    said = hddp::currentFailure();
  }
  EXPECT_EQ(said.failure, hddp::FailureKind::OutOfMemory) << said.message;
  EXPECT_NE(said.message.find("can't allocate memory"), std::string::npos) << said.message;
  try {
    try {
      at::empty({int64_t{1} << 50}, at::kByte);
    } catch (const c10::Error&) {
      hddp::rethrowIfOutOfMemory();
      FAIL() << "not rethrown";
    }
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("DefaultCPUAllocator"),
              std::string::npos);
  }
  try {
    try {
      TORCH_CHECK(false, "a damaged file");
    } catch (const c10::Error&) {
      hddp::rethrowIfOutOfMemory();  // not memory: goes on
      said = hddp::currentFailure();
    }
  } catch (...) {
    FAIL() << "rethrown though not out of memory";
  }
  EXPECT_EQ(said.failure, hddp::FailureKind::Foreign);
}

}  // namespace
