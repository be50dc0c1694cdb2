// The inputs the fuzzers found (fuzz/regressions/, issue #49 part 2), replayed in the
// ordinary suite: each reader refuses its input with its own clear error, without a
// crash, undefined behaviour or an exception of another kind.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "hddp/balance/device_table.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp_protocol/job_record.h"
#include "hddp_protocol/launch.h"
#include "support/ranks.h"
#include "support/trainer_runs.h"

namespace fs = std::filesystem;

namespace {

std::string regression(const std::string& target, const std::string& name) {
  return std::string(HDDP_TEST_SOURCE_DIR) + "/../fuzz/regressions/" + target + "/" + name;
}

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// A header whose dimensions multiply past int64 (signed overflow before), and one with a
// dimension of 0 (a memcpy from null before).
TEST(FuzzRegressions, IdxHeadersThatOverflowOrHoldNothing) {
  EXPECT_THROW(hddp::readIdx(regression("fuzz_idx", "element-count-overflows-int64.idx")),
               hddp::DataError);
  try {
    const at::Tensor t = hddp::readIdx(regression("fuzz_idx", "zero-size-memcpy-from-null.idx"));
    EXPECT_EQ(t.numel(), 0);
  } catch (const hddp::DataError&) {
    // refused with a clear error: as good
  }
}

// {"devices": 1e400}: nlohmann's out_of_range escaped as another kind of exception.
TEST(FuzzRegressions, ADeviceTableNumberBeyondADoubleIsAConfigError) {
  EXPECT_THROW(hddp::DeviceTable::parse(
                   contents(regression("fuzz_device_table", "number-beyond-double.json")), "t"),
               hddp::ConfigError);
}

// A job record line whose event is a number (a type_error escaped), and one whose pid is
// 1e300 (an out-of-range conversion, undefined behaviour): both lines are skipped.
TEST(FuzzRegressions, JobRecordLinesOfWrongTypesOrRangesAreSkipped) {
  for (const char* name : {"event-is-a-number.jsonl", "pid-beyond-int64.jsonl"}) {
    const std::string dir = hddp::testing::makeTempDir();
    std::ofstream(dir + "/" + hddp::protocol::kJobRecordFile)
        << "{\"t\":1,\"event\":\"job\",\"min\":2,\"max\":3,\"pid\":7}\n"
        << contents(regression("fuzz_job_record", name)) << "\n";
    try {
      const auto job = hddp::jobrecord::read(dir);
      EXPECT_GE(job.skippedLines, 1) << name;
    } catch (const std::runtime_error& e) {
      // the record's own error for a file without a job event
      EXPECT_NE(std::string(e.what()).find("has no \"job\" event"), std::string::npos)
          << name << ": " << e.what();
    }
  }
}

// A state file whose payload is no archive: LibTorch's c10::Error escaped, not naming the
// file; now a StateError that names it.
TEST(FuzzRegressions, AStateFileWithoutAnArchiveIsAStateErrorNamingIt) {
  const std::string path = regression("fuzz_state_file", "payload-is-not-an-archive.hddp");
  std::string error;
  hddp::testing::runThreads(1, [&](int rank, int size, hddp::Store& store) {
    error = hddp::testing::stateError([&] {
      hddp::testing::trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
        o.resume = path;
        o.maxSteps = 1;
        o.loader.workers = 0;
      });
    });
  });
  EXPECT_NE(error.find("holds no readable archive"), std::string::npos) << error;
  EXPECT_NE(error.find(path), std::string::npos) << error;
}

}  // namespace
