// The inputs the fuzzers found (fuzz/regressions/, issue #49 part 2), replayed in the
// ordinary suite: each reader refuses its input with its own clear error, without a
// crash, undefined behaviour or an exception of another kind.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "hddp/balance/device_table.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/state_file.h"
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
  // A 0 beside dimensions whose product passes int64 (LibTorch's strides overflowed: a
  // c10::Error escaped).
  EXPECT_THROW(
      hddp::readIdx(regression("fuzz_idx", "zero-dimension-beside-dimensions-past-int64.idx")),
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

// Two state files of 27 KB with valid checksums whose data.pkl makes LibTorch's unpickler
// allocate gigabytes: a memo index of 671 million (it made room for every index below, 10
// GB) and a string claiming 1.6 GB (allocated before reading). Now refused before LibTorch
// reads the archive: a StateError naming the file and the claim.
TEST(FuzzRegressions, AStateFilesPickleClaimingGigabytesIsRefusedBeforeLibTorchReadsIt) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"unpickler-memo-allocates-10-GB.hddp", "beyond the pickle's own size"},
      {"unpickler-string-allocates-1.6-GB.hddp", "bytes where"}};
  for (const auto& [name, claim] : cases) {
    const std::string path = regression("fuzz_state_file", name);
    ASSERT_NO_THROW(hddp::readStateFile(path)) << name << ": its checksum is valid";
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
    EXPECT_NE(error.find(path), std::string::npos) << error;
    EXPECT_NE(error.find("data.pkl"), std::string::npos) << error;
    EXPECT_NE(error.find(claim), std::string::npos) << error;
  }
}

// A 9-byte JPEG whose Huffman table counts 510 codes (Debian's stb_image 2.27 writes past
// its 257-entry table, in stbi_info already; again behind fill bytes before its SOI, which
// stb_image skips), a 29-byte GIF declaring 19973 x 26676 pixels
// (stb_image allocated and cleared 4 GB) and a 16-bit PGM read as RGB (stb_image 2.27
// converted it as 8-bit, then read past that buffer): refused before stb_image decodes
// them, a DataError naming the file and the claim.
TEST(FuzzRegressions, ImagesThatOverrunStbImageAreRefusedBeforeDecoding) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"jpeg-huffman-counts-over-256.jpg", "Huffman table (DHT segment at byte 2) counts 510"},
      {"jpeg-huffman-counts-over-256-after-fill-bytes.jpg", "codes, more than the 256 a table"},
      {"gif-of-29-bytes-takes-4-GB.gif", "19973x26676 pixels, more than its 29 bytes"},
      {"pgm-of-16-bits-converted-past-its-buffer.pgm", "a 16-bit PGM read as 3 channel(s)"}};
  for (const auto& [name, claim] : cases) {
    const std::string path = regression("fuzz_image", name);
    for (const int channels : {3, 1}) {
      if (name.rfind("pgm-", 0) == 0 && channels == 1) {
        continue;  // a 16-bit PGM read as it is: stb_image converts 16 to 8 bits within bounds
      }
      std::string error = "(no DataError)";
      try {
        hddp::decodeImage(path, channels);
      } catch (const hddp::DataError& e) {
        error = e.what_without_backtrace();
      }
      EXPECT_NE(error.find(path), std::string::npos) << error;
      EXPECT_NE(error.find(claim), std::string::npos) << error;
    }
  }
}

}  // namespace
