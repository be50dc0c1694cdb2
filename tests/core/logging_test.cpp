// Logging: level names, and lines that carry the rank and the layer and respect the
// level (captured through the line handler, not stderr).
#include "hddp/core/logging.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hddp/core/error.h"

namespace {

TEST(Logging, ParseLevels) {
  using hddp::log::Level;
  EXPECT_EQ(hddp::log::parseLevel("DEBUG"), Level::Debug);
  EXPECT_EQ(hddp::log::parseLevel("warning"), Level::Warn);
  EXPECT_EQ(hddp::log::parseLevel("off"), Level::Off);
  EXPECT_THROW(hddp::log::parseLevel("loud"), hddp::ConfigError);
}

TEST(Logging, LinesCarryRankAndLayerAndRespectTheLevel) {
  std::vector<std::string> lines;
  hddp::log::setLineHandler(
      [&lines](hddp::log::Level, const std::string& line) { lines.push_back(line); });
  hddp::log::setLevel(hddp::log::Level::Info);
  hddp::log::setRank(3);
  HDDP_LOG_INFO("comm", "visible ", 42);
  HDDP_LOG_DEBUG("comm", "hidden");
  EXPECT_EQ(hddp::log::rank(), 3);
  hddp::log::setRank(-1);
  HDDP_LOG_WARN("train", "no rank");
  hddp::log::setLineHandler(nullptr);
  HDDP_LOG_INFO("comm", "to stderr, not captured");
  EXPECT_EQ(lines, (std::vector<std::string>{"[rank 3] [hddp.comm] [info] visible 42",
                                             "[hddp.train] [warn] no rank"}));
}

}  // namespace
