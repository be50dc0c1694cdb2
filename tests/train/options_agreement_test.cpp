// The options that shape the ranks' collectives are compared at the Trainer's construction
// (src/train/options_agreement.h): a difference is a ConfigError on every rank that names
// the option and each rank's value, never a hang; what may differ by rank does not fail.
#include "train/options_agreement.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"

namespace {

// Each rank's error text ("" when it agreed) with rank r's options made by `configure`.
std::vector<std::string> agree(const std::function<void(int, hddp::TrainerOptions&)>& configure) {
  std::vector<std::string> errors(2);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::TrainerOptions o;
    configure(rank, o);
    try {
      hddp::train::checkOptionsAgree(*comm, o);
    } catch (const hddp::ConfigError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
  });
  return errors;
}

// bf16 autocast or none is each rank's own choice (--amp auto picks bf16 where the
// device has it natively): no collective depends on it, so it may differ.
TEST(OptionsAgreement, Bf16OnOneRankAndNoneOnAnotherAgree) {
  const auto errors = agree([](int rank, hddp::TrainerOptions& o) {
    o.amp = rank == 0 ? hddp::AmpMode::Bf16 : hddp::AmpMode::Off;
  });
  EXPECT_EQ(errors, std::vector<std::string>(2, ""));
}

// fp16 brings the GradScaler's found-inf allreduce: on some ranks only, it would pair
// with another collective.
TEST(OptionsAgreement, Fp16OnOneRankOnlyIsAnErrorOnEveryRank) {
  const auto errors = agree([](int rank, hddp::TrainerOptions& o) {
    o.amp = rank == 0 ? hddp::AmpMode::Fp16 : hddp::AmpMode::Bf16;
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("TrainerOptions::amp.fp16 (rank 0: 1, rank 1: 0)"), std::string::npos) << e;
  }
}

TEST(OptionsAgreement, AnotherBufferSyncIntervalIsAnErrorOnEveryRank) {
  const auto errors =
      agree([](int rank, hddp::TrainerOptions& o) { o.ddp.bufferSyncInterval = rank + 1; });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("TrainerOptions::ddp.bufferSync"), std::string::npos) << e;
  }
}

// PowerSGD's seed picks the starting Qs that every rank multiplies its gradient by
// before the sum: another seed on one rank would sum products of different Qs.
TEST(OptionsAgreement, AnotherPowerSgdSeedIsAnErrorOnEveryRank) {
  const auto errors = agree([](int rank, hddp::TrainerOptions& o) {
    o.ddp.powerSgd.randomSeed = static_cast<uint64_t>(rank);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("TrainerOptions::ddp.powerSgd"), std::string::npos) << e;
  }
}

}  // namespace
