// Logging: level names, and lines that carry the rank and the layer and respect the
// level (captured through the line handler, not stderr).
#include "hddp/core/logging.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hddp/core/error.h"
#include "train/metrics.h"

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

// Under hddp-run, which starts each line of a rank's stderr with "[rank N] ", hddp's
// own prefix leaves the rank out, so a line carries it once (issue #38); a line handler
// still gets it.
TEST(Logging, TheRankAppearsOnceWhenTheLauncherPrefixesIt) {
  hddp::log::setLevel(hddp::log::Level::Info);
  hddp::log::setRank(1);
  testing::internal::CaptureStderr();
  HDDP_LOG_INFO("comm", "own prefix");
  hddp::log::setLauncherPrefixesRank(true);
  HDDP_LOG_INFO("comm", "launcher's prefix");
  std::vector<std::string> lines;
  hddp::log::setLineHandler(
      [&lines](hddp::log::Level, const std::string& line) { lines.push_back(line); });
  HDDP_LOG_INFO("comm", "to the handler");
  hddp::log::setLineHandler(nullptr);
  hddp::log::setLauncherPrefixesRank(false);
  hddp::log::setRank(-1);
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find("] [rank 1] [hddp.comm] [info] own prefix"), std::string::npos) << out;
  const size_t line = out.find("launcher's prefix");
  ASSERT_NE(line, std::string::npos) << out;
  const size_t start = out.rfind('\n', line);
  const std::string second = out.substr(start == std::string::npos ? 0 : start + 1);
  EXPECT_EQ(second.find("[rank"), std::string::npos) << second;
  EXPECT_NE(second.find("] [hddp.comm] [info] launcher's prefix"), std::string::npos) << second;
  EXPECT_EQ(lines, (std::vector<std::string>{"[rank 1] [hddp.comm] [info] to the handler"}));
}

// A rank alone in a terminal draws its live bar on stderr itself; its own log lines
// clear the bar first and are written whole, never onto it (issue #32, item 19).
TEST(Logging, ALogLineClearsTheLiveProgressBarFirst) {
  hddp::log::setLevel(hddp::log::Level::Info);
  hddp::train::Progress progress(/*enabled=*/true, /*live=*/true, /*every=*/1);
  testing::internal::CaptureStderr();
  progress.step(0, 1, 4, 10, 0.5, 123.0, "");
  HDDP_LOG_INFO("balance", "a new plan");
  progress.step(0, 1, 9, 10, 0.25, 124.0, "");
  progress.line("epoch summary");
  const std::string out = testing::internal::GetCapturedStderr();
  // The bar is wiped ("\r" + erase line) and the log line (its time stamp first) takes
  // its place; without that the line would follow "samples/s" on the bar's line.
  EXPECT_NE(out.find("123 samples/s\r\033[K["), std::string::npos) << out;
  EXPECT_NE(out.find("a new plan"), std::string::npos) << out;
  // The last bar stays on screen, ended by a newline, above the summary.
  EXPECT_NE(out.find("124 samples/s\nepoch summary\n"), std::string::npos) << out;
}

}  // namespace
