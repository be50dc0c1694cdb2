// The inputs the fuzzers found (fuzz/regressions/, issue #49 part 2), replayed in the
// ordinary suite: each reader refuses its input with its own clear error, without a
// crash, undefined behaviour or an exception of another kind.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "data/image_decode.h"
#include "hddp/balance/device_table.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/state_file.h"
#include "hddp/train/trainer.h"
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

namespace {

// The StateError text of loading a kept fuzz_state_file input as the target loads it: its
// length and checksum made right, into the same one-rank job (a Linear and a BatchNorm,
// SGD with momentum). Empty when the load did not throw a StateError.
std::string loadAsTheFuzzTargetDoes(const std::string& name) {
  std::ifstream in(regression("fuzz_state_file", name), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_GT(bytes.size(), 20u) << name;
  if (bytes.size() <= 20) {
    return "";
  }
  auto put = [&bytes](size_t at, uint64_t value, int n) {
    for (int i = 0; i < n; ++i) {
      bytes[at + static_cast<size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
    }
  };
  put(8, bytes.size() - 20, 8);
  put(16, hddp::crc32Of(bytes.data() + 20, bytes.size() - 20), 4);
  const std::string path = hddp::testing::makeTempDir() + "/state-00000002.hddp";
  std::ofstream(path, std::ios::binary) << bytes;
  std::string error;
  hddp::testing::runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::nn::Sequential net{torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3)};
    torch::optim::SGD optimizer{net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.epochs = 1;
    o.seedPlan = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    auto data = std::make_shared<hddp::SyntheticClassificationDataset>(32, 1, 2, 3, /*seed=*/5);
    hddp::Trainer trainer(
        *comm, net.ptr(), [net](const at::Tensor& x) mutable { return net->forward(x.flatten(1)); },
        hddp::crossEntropy(), optimizer, data, o);
    try {
      trainer.load(path);
    } catch (const hddp::StateError& e) {
      error = e.what();
    }
  });
  return error;
}

}  // namespace

// State files whose entries hold what LibTorch's own checks refuse (found by the CI runs'
// 30 s of fuzz_state_file, 2026-12-07): a planner entry of another type than hddp writes
// (read through a pointer of the written type) and a random number generator state that
// is not one ("Invalid mt19937 state"): c10::Errors. Now StateErrors that say so.
TEST(FuzzRegressions, StateFileEntriesThatLibTorchRefusesAreStateErrors) {
  const std::string planner = loadAsTheFuzzTargetDoes("planner-entry-of-another-type.hddp");
  EXPECT_NE(planner.find("the planner's"), std::string::npos) << planner;
  EXPECT_NE(planner.find("the state file is damaged or not hddp's"), std::string::npos) << planner;
  const std::string rng = loadAsTheFuzzTargetDoes("rng-state-that-is-not-one.hddp");
  EXPECT_NE(rng.find("random number generator state"), std::string::npos) << rng;
  // A number beyond int where LibTorch converts one (std::runtime_error: the scaler's
  // growth tracker), in a file whose 'rank0' part is no archive either: the load reads and
  // checks the scaler, on a scaler of its own, with the model and optimizer, before the
  // ranks' parts and before it applies anything, so the tracker is refused first, a
  // StateError naming it (before, LibTorch's refusal came while the scaler was applied:
  // "LibTorch refused what the state file holds").
  const std::string big = loadAsTheFuzzTargetDoes("value-beyond-int.hddp");
  EXPECT_NE(big.find("'growth_tracker' is"), std::string::npos) << big;
}

// The images the fuzzers found, each a fault of Debian's stb_image 2.27, hddp's decoder of
// every format before: a 9-byte JPEG whose Huffman table counts 510 codes (stb_image
// wrote past its 257-entry table; again behind fill bytes before its SOI), a 29-byte GIF
// declaring 19973 x 26676 pixels (stb_image allocated and cleared 4 GB), a 16-bit PGM
// read as RGB (converted as 8-bit, then read past that buffer), a PGM whose header
// number overflowed stb_image's int, and a PNG whose empty first IDAT made stb_image
// copy from a null pointer (that PNG's CRCs are wrong too, which stb_image does not
// check; a valid PNG with an empty first IDAT decodes: ImageDecode.
// PngWithAnEmptyFirstIdatDecodes). Now libjpeg-turbo, libpng and hddp's own PGM/PPM
// reader refuse them with their reason, and the GIF, which stb_image still reads, is
// refused before it by the size check: a DataError naming the file and the claim, for 1
// and 3 channels. And one that the first run of fuzz_image on the new decoders found: a
// 31-byte BMP stored top-down (negative height, which stbi_info passes on as it is)
// claiming 16449575 x 2 pixels; the negative product passed the size check, and
// stb_image decoded 33 million pixels from zeros (a timeout under the sanitizers).
TEST(FuzzRegressions, ImagesThatBrokeStbImageAreRefusedWithTheirReason) {
  std::vector<std::pair<std::string, std::string>> cases = {
      {"jpeg-huffman-counts-over-256.jpg", "(JPEG): Bogus marker length"},
      {"jpeg-huffman-counts-over-256-after-fill-bytes.jpg",
       "(JPEG): Bogus Huffman table definition"},
      {"png-empty-first-idat-memcpy-from-null.png", "(PNG): IHDR: CRC error"},
      {"gif-of-29-bytes-takes-4-GB.gif", "19973x26676 pixels, more than its 29 bytes"},
      {"pgm-of-16-bits-converted-past-its-buffer.pgm",
       "its PGM/PPM header has no whitespace before its width (byte 2)"},
      {"pgm-header-integer-overflows-int.pgm",
       "its PGM/PPM header has no whitespace before its width (byte 2)"},
      {"bmp-top-down-height-passes-the-size-check.bmp",
       "16449575x2 pixels, more than its 31 bytes can describe as BMP"}};
  if (hddp::data::pngJpegDecoders().find("stb_image") != std::string::npos) {
    cases.erase(cases.begin(), cases.begin() + 3);  // stb_image's fallback words
  }
  for (const auto& [name, claim] : cases) {
    const std::string path = regression("fuzz_image", name);
    for (const int channels : {3, 1}) {
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
