// The what-if device table (hddp/balance/device_table.h): the shipped table loads and
// every entry has a source; bad entries give errors that name the file, entry and
// field; lookups suggest the closest key; mixes parse.
#include "hddp/balance/device_table.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <string>

#include "hddp/core/error.h"

namespace {

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const hddp::ConfigError& e) {
    return e.what_without_backtrace();
  }
  return "(no ConfigError)";
}

TEST(DeviceTable, TheShippedTableLoadsAndEveryEntryHasASource) {
  const auto table = hddp::DeviceTable::load(HDDP_TEST_DEVICE_TABLE);
  EXPECT_GE(table.devices().size(), 10u);
  EXPECT_GE(table.links().size(), 10u);
  for (const auto& [key, d] : table.devices()) {
    EXPECT_FALSE(d.source.empty()) << key;
    EXPECT_GE(d.fp16Tflops, d.fp32Tflops) << key << ": tensor cores are faster than FP32";
  }
  for (const std::string link : {"pcie3x16", "pcie4x16", "tb3", "tb4", "usb4", "oculink"}) {
    EXPECT_NO_THROW(table.link(link)) << link;
  }
  EXPECT_LT(table.link("tb3").GBps, table.link("pcie3x4").GBps) << "the tunnel costs";
  EXPECT_EQ(table.device("RTX4090").memoryGiB, 24);
  EXPECT_EQ(table.device("rtx2080ti").bf16Tflops, 0) << "Turing has no bf16";
}

TEST(DeviceTable, BadEntriesSayWhichFileEntryAndField) {
  auto parse = [](const std::string& text) {
    return errorOf([&] { hddp::DeviceTable::parse(text, "mine.json"); });
  };
  const std::string good =
      R"("name": "X", "fp32_tflops": 10, "fp16_tflops": 20, "bf16_tflops": 0, "memory_gib": 8,
         "memory_GBps": 400, "source": "my datasheet")";
  EXPECT_EQ(parse(R"({"devices": {"x1": {)" + good + "}}}"), "(no ConfigError)");
  EXPECT_NE(parse("{not json").find("mine.json is not valid JSON"), std::string::npos);
  EXPECT_NE(parse(R"({"gpus": {}})").find("mine.json: unknown field 'gpus'"), std::string::npos);
  EXPECT_NE(parse(R"({"devices": {"x1": {"name": "X"}}})")
                .find("mine.json: device 'x1': missing field 'fp32_tflops'"),
            std::string::npos);
  std::string negative = good;
  negative.replace(negative.find("10"), 2, "-1");
  EXPECT_NE(parse(R"({"devices": {"x1": {)" + negative + "}}}")
                .find("device 'x1': 'fp32_tflops' must be positive, not -1"),
            std::string::npos);
  std::string typo = good;
  typo.replace(typo.find("memory_gib"), 10, "memory_gb");
  EXPECT_NE(parse(R"({"devices": {"x1": {)" + typo + "}}}").find("unknown field 'memory_gb'"),
            std::string::npos);
  std::string noSource = good;
  noSource.replace(noSource.find("my datasheet"), 12, "");
  EXPECT_NE(parse(R"({"devices": {"x1": {)" + noSource + "}}}")
                .find("'source' must be a non-empty string (where the figures come from"),
            std::string::npos);
  EXPECT_NE(parse(R"({"devices": {"X 1": {)" + good + "}}}").find("a key is lower case"),
            std::string::npos);
  EXPECT_NE(parse(R"({"links": {"tb9": {"name": "T", "GBps": "fast", "source": "s"}}})")
                .find("link 'tb9': 'GBps' must be a number, not \"fast\""),
            std::string::npos);
  EXPECT_NE(errorOf([] {
              hddp::DeviceTable::load("/nonexistent/devices.json");
            }).find("cannot read the device table /nonexistent/devices.json"),
            std::string::npos);
}

TEST(DeviceTable, UsersAddAndOverrideEntriesAndMixesParse) {
  auto table = hddp::DeviceTable::load(HDDP_TEST_DEVICE_TABLE);
  table.merge(hddp::DeviceTable::parse(
      R"J({"devices": {"rtx4090": {"name": "My 4090 (power-limited)", "fp32_tflops": 60,
           "fp16_tflops": 120, "bf16_tflops": 120, "memory_gib": 24, "memory_GBps": 1008,
           "source": "measured"}},
          "links": {"tb3dock": {"name": "my dock", "GBps": 2.2, "source": "measured"}}})J",
      "mine.json"));
  EXPECT_EQ(table.device("rtx4090").fp32Tflops, 60);
  EXPECT_EQ(table.device("rtx3090").fp32Tflops, 35.6) << "the others stay";
  const auto mix = table.parseMix("rtx4090@pcie4x16, rtx3060@tb3dock,rtx3090");
  ASSERT_EQ(mix.size(), 3u);
  EXPECT_EQ(mix[1].link.GBps, 2.2);
  EXPECT_EQ(mix[2].link.key, "pcie4x16") << "the default link";
  EXPECT_NE(errorOf([&] { table.parseMix("rtx409@tb3"); })
                .find("item 'rtx409@tb3': no device 'rtx409' in the device table (did you "
                      "mean 'rtx4090'?"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { table.parseMix("rtx4090@tb6"); }).find("no link 'tb6'"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { table.parseMix("rtx4090@@tb3"); }).find("is not DEVICE[@LINK]"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { table.parseMix("rtx4090,,rtx3060"); }).find("an empty item"),
            std::string::npos);
}

// The built-in table: HDDP_DEVICE_TABLE when set (a user's whole table), else hddp's.
TEST(DeviceTable, TheBuiltInTableIsHddpsUnlessTheEnvironmentNamesAnother) {
  unsetenv("HDDP_DEVICE_TABLE");
  EXPECT_GE(hddp::DeviceTable::builtIn().devices().size(), 10u);
  setenv("HDDP_DEVICE_TABLE", "/nonexistent/table.json", 1);
  EXPECT_NE(errorOf([] {
              hddp::DeviceTable::builtIn();
            }).find("cannot read the device table /nonexistent/table.json"),
            std::string::npos);
  unsetenv("HDDP_DEVICE_TABLE");
}

}  // namespace
