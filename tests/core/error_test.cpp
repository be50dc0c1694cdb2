#include "hddp/core/error.h"

#include <gtest/gtest.h>

#include <string>

namespace {

std::string messageOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Error, CheckMessageCarriesValuesAndLocation) {
  const int rank = 7;
  const int world = 4;
  const std::string msg = messageOf(
      [&] { HDDP_CHECK(rank < world, "rank ", rank, " is not below the world size ", world); });
  EXPECT_NE(msg.find("rank 7 is not below the world size 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("error_test.cpp"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hddp: "), std::string::npos) << msg;
}

TEST(Error, PassingCheckDoesNotThrow) { EXPECT_NO_THROW(HDDP_CHECK(1 + 1 == 2, "arithmetic")); }

TEST(Error, TypedErrorsAreCatchableAsC10AndStd) {
  EXPECT_THROW(HDDP_CHECK_AS(hddp::TimeoutError, false, "late"), hddp::TimeoutError);
  EXPECT_THROW(HDDP_CHECK_AS(hddp::TimeoutError, false, "late"), hddp::DistributedError);
  EXPECT_THROW(HDDP_CHECK_AS(hddp::StoreError, false, "gone"), c10::Error);
  EXPECT_THROW(HDDP_CHECK_AS(hddp::BackendError, false, "peer died"), std::exception);
  EXPECT_THROW(HDDP_CHECK(false, "bad"), hddp::Error);
  // A plain misuse error is not mistaken for a distributed one.
  bool caughtAsDistributed = false;
  try {
    HDDP_CHECK(false, "bad");
  } catch (const hddp::DistributedError&) {
    caughtAsDistributed = true;
  } catch (const hddp::Error&) {
  }
  EXPECT_FALSE(caughtAsDistributed);
}

TEST(Error, InternalAssertSaysItIsABug) {
  const std::string msg = messageOf([] { HDDP_INTERNAL_ASSERT(2 < 1, "size ", 3); });
  EXPECT_NE(msg.find("internal assertion `2 < 1` failed: size 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bug in hddp"), std::string::npos) << msg;
  EXPECT_THROW(HDDP_INTERNAL_ASSERT(false, ""), hddp::InternalError);
}

}  // namespace
