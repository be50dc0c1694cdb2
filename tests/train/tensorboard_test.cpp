// TensorBoard event files: CRC-32C against published vectors, the record framing and
// the Event messages byte for byte against what TensorBoard's own Python writer and
// protos produce, a writer's file read back record by record (lengths, both CRCs, the
// fields by TensorFlow's numbers), its flushes and failures. The Trainer's TensorBoard
// output is tests/train/tensorboard_trainer_test.cpp's.
#include "hddp/train/tensorboard.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hddp/core/error.h"
#include "support/disk.h"
#include "support/event_records.h"
#include "support/ranks.h"

#if HDDP_TEST_TENSORBOARD
#include "train/event_file.h"
#endif

namespace {

#if HDDP_TEST_TENSORBOARD

using hddp::testing::FileSizeLimit;
using hddp::testing::removeTree;
using hddp::testing::event_records::asDouble;
using hddp::testing::event_records::asFloat;
using hddp::testing::event_records::checkedRecords;
using hddp::testing::event_records::eventFiles;
using hddp::testing::event_records::field;
using hddp::testing::event_records::hasField;
using hddp::testing::event_records::hex;
using hddp::train::crc32c;
using hddp::train::frameRecord;
using hddp::train::maskedCrc32c;
namespace events = hddp::train::events;

uint32_t crcOf(const std::string& s) { return crc32c(s.data(), s.size()); }

// RFC 3720 (iSCSI) B.4 and the common check value.
TEST(TensorBoardCrc32c, MatchesPublishedVectors) {
  EXPECT_EQ(crcOf("123456789"), 0xE3069283u);
  EXPECT_EQ(crcOf(""), 0u);
  EXPECT_EQ(crcOf(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crcOf(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending += static_cast<char>(i);
    descending += static_cast<char>(31 - i);
  }
  EXPECT_EQ(crcOf(ascending), 0x46DD794Eu);
  EXPECT_EQ(crcOf(descending), 0x113FDB5Cu);
}

TEST(TensorBoardCrc32c, MaskRotatesAndAddsTheConstant) {
  const uint32_t crc = 0xE3069283u;
  EXPECT_EQ(maskedCrc32c("123456789", 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

// The bytes of tensorboard.summary.writer.record_writer.RecordWriter().write(b"hello").
TEST(TensorBoardRecords, FrameIsTensorBoardsOwn) {
  EXPECT_EQ(hex(frameRecord("hello")), "0500000000000000eab2043e68656c6c6fbb1f1c19");
}

// The bytes of tensorboard.compat.proto's Event for the same values (serialized by
// TensorBoard 2.21's Python protobuf).
TEST(TensorBoardRecords, EventsAreTensorBoardsOwnBytes) {
  EXPECT_EQ(hex(events::fileVersion(1000.5)), "090000000000448f401a0d627261696e2e4576656e743a32");
  EXPECT_EQ(hex(events::scalar("train/loss", 0.5f, 3, 1000.5)),
            "090000000000448f4010032a130a110a0a747261696e2f6c6f7373150000003f");
  // Value{tag, tensor{DT_STRING, shape{}, string_val}, metadata{plugin "text",
  // DATA_CLASS_TENSOR}}.
  EXPECT_EQ(hex(events::text("plan", "step 1: [3, 1] of 4", 3, 1000.5)),
            "090000000000448f4010032a2f0a2d0a04706c616e42190807120042137374657020313a205b332c2"
            "0315d206f6620344a0a0a060a04746578742002");
  EXPECT_EQ(hex(events::sessionStart(7, 1000.5)), "090000000000448f4010073a020801");
}

// ---- a writer's file read back record by record ---------------------------------------

TEST(TensorBoardWriter, FileReadsBackRecordByRecord) {
  const std::string dir = hddp::testing::makeTempDir() + "/runs/a";  // made by the writer
  std::string path;
  {
    hddp::TensorBoardWriter tb(dir);
    path = tb.path();
    tb.markStart(1, 999.0);
    tb.addScalar("train/loss", 2.25, 1, 1000.0);
    tb.addScalar("train/loss", 1.5, 2, 1001.0);
    tb.addText("plan", "step 1: [3, 1] of 4", 1, 1000.0);
    tb.addScalar("eval/test_acc", 0.75, 2);  // wall time: now
  }                                          // the destructor flushes
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_NE(name.find("." + std::to_string(::getpid()) + ".hddp"), std::string::npos) << name;
  EXPECT_EQ(eventFiles(dir), std::vector<std::string>{name});

  const auto records = checkedRecords(path);
  ASSERT_EQ(records.size(), 6u);
  // Event: wall_time 1 (double), step 2, file_version 3, summary 5, session_log 7.
  EXPECT_EQ(field(records[0], 3).bytes, "brain.Event:2");
  EXPECT_GT(asDouble(field(records[0], 1).value), 1.6e9);  // now, in Unix seconds

  EXPECT_EQ(field(records[1], 2).value, 1u);
  EXPECT_EQ(field(field(records[1], 7).bytes, 1).value, 1u);  // SessionLog.status START
  EXPECT_EQ(asDouble(field(records[1], 1).value), 999.0);

  const std::pair<int64_t, float> losses[] = {{1, 2.25f}, {2, 1.5f}};
  for (int i = 0; i < 2; ++i) {
    const std::string& e = records[static_cast<size_t>(2 + i)];
    EXPECT_EQ(field(e, 1).wire, 1);
    EXPECT_EQ(asDouble(field(e, 1).value), 1000.0 + i);
    EXPECT_EQ(static_cast<int64_t>(field(e, 2).value), losses[i].first);
    // Summary.value 1 -> Value: tag 1, simple_value 2 (float).
    const std::string value = field(field(e, 5).bytes, 1).bytes;
    EXPECT_EQ(field(value, 1).bytes, "train/loss");
    EXPECT_EQ(field(value, 2).wire, 5);
    EXPECT_EQ(asFloat(field(value, 2).value), losses[i].second);
  }

  // Value: tag 1, tensor 8 {dtype 1 = DT_STRING 7, tensor_shape 2 (no dims), string_val
  // 8}, metadata 9 {plugin_data 1 {plugin_name 1}, data_class 4 = TENSOR 2}.
  const std::string text = field(field(records[4], 5).bytes, 1).bytes;
  EXPECT_EQ(field(text, 1).bytes, "plan");
  const std::string tensor = field(text, 8).bytes;
  EXPECT_EQ(field(tensor, 1).value, 7u);
  EXPECT_TRUE(field(tensor, 2).bytes.empty());
  EXPECT_EQ(field(tensor, 8).bytes, "step 1: [3, 1] of 4");
  const std::string metadata = field(text, 9).bytes;
  EXPECT_EQ(field(field(metadata, 1).bytes, 1).bytes, "text");
  EXPECT_EQ(field(metadata, 4).value, 2u);
  EXPECT_FALSE(hasField(text, 2));

  const std::string acc = field(field(records[5], 5).bytes, 1).bytes;
  EXPECT_EQ(field(acc, 1).bytes, "eval/test_acc");
  EXPECT_EQ(asFloat(field(acc, 2).value), 0.75f);
  EXPECT_GT(asDouble(field(records[5], 1).value), 1.6e9);
  removeTree(std::filesystem::path(dir).parent_path().parent_path().string());
}

// A live TensorBoard sees what flush() wrote while the writer is still open.
TEST(TensorBoardWriter, FlushMakesRecordsVisibleWhileOpen) {
  const std::string dir = hddp::testing::makeTempDir();
  hddp::TensorBoardWriter tb(dir);
  EXPECT_EQ(checkedRecords(tb.path()).size(), 1u);  // the version, flushed by the constructor
  tb.addScalar("train/loss", 1.0, 1);
  tb.flush();
  EXPECT_EQ(checkedRecords(tb.path()).size(), 2u);
  removeTree(dir);
}

// Two writers in one second: two files, named in the order they were made.
TEST(TensorBoardWriter, SecondWriterInTheSameSecondGetsANameSortedAfter) {
  const std::string dir = hddp::testing::makeTempDir();
  std::string first, second;
  {
    hddp::TensorBoardWriter a(dir);
    hddp::TensorBoardWriter b(dir);
    first = std::filesystem::path(a.path()).filename().string();
    second = std::filesystem::path(b.path()).filename().string();
  }
  EXPECT_NE(first, second);
  EXPECT_LT(first, second);
  EXPECT_EQ(eventFiles(dir), (std::vector<std::string>{first, second}));
  removeTree(dir);
}

TEST(TensorBoardWriter, FolderThatCannotBeMadeIsAnErrorNamingIt) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string file = dir + "/a_file";
  std::ofstream(file) << "not a folder";
  try {
    hddp::TensorBoardWriter tb(file + "/runs");
    FAIL() << "a folder under a file was accepted";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(file + "/runs"), std::string::npos) << e.what();
  }
  removeTree(dir);
}

// A disk that takes no more (here: the file size limit, RLIMIT_FSIZE): the write that
// fails throws, naming the file, and the destructor after it does not throw.
TEST(TensorBoardWriter, AFailedWriteIsAnErrorNamingTheFile) {
  const std::string dir = hddp::testing::makeTempDir();
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto oldHandler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  std::string path, error;
  {
    hddp::TensorBoardWriter tb(dir);
    path = tb.path();
    struct rlimit small = old;
    small.rlim_cur = 4096;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    try {
      for (int i = 0; i < 1000; ++i) {  // ~45 bytes each
        tb.addScalar("train/loss", 1.0, i);
      }
      tb.flush();
    } catch (const hddp::Error& e) {
      error = e.what();
    }
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, oldHandler);
  EXPECT_NE(error.find("cannot write the TensorBoard event file " + path), std::string::npos)
      << error;
  EXPECT_NE(error.find(std::strerror(EFBIG)), std::string::npos) << error;
  removeTree(dir);
}

// After a failed write the writer takes nothing more: every add and flush throws, so
// nothing is appended after the failure, and the file holds whole records only (the
// torn one is cut off), each readable.
TEST(TensorBoardWriter, AfterAFailedWriteEveryCallThrowsAndTheFileKeepsWholeRecords) {
  const std::string dir = hddp::testing::makeTempDir();
  std::string path;
  std::vector<std::string> laterErrors;
  bool failedAfter = false;
  {
    hddp::TensorBoardWriter tb(dir);
    path = tb.path();
    EXPECT_FALSE(tb.failed());
    {
      const FileSizeLimit full(4000);  // not a multiple of the records' size
      try {
        for (int i = 1; i <= 1000; ++i) {
          tb.addScalar("train/loss", 1.0, i);
        }
        tb.flush();
        ADD_FAILURE() << "no write failed";
      } catch (const hddp::Error&) {
      }
    }
    failedAfter = tb.failed();
    const std::vector<std::function<void()>> later = {
        [&] { tb.addScalar("train/loss", 2.0, 2000); },
        [&] { tb.addText("plan", "later", 2000); },
        [&] { tb.markStart(2000); },
        [&] { tb.flush(); },
    };
    for (const auto& call : later) {
      try {
        call();
        laterErrors.push_back("(no error)");
      } catch (const hddp::Error& e) {
        laterErrors.push_back(e.what_without_backtrace());
      }
    }
  }
  EXPECT_TRUE(failedAfter);
  for (const std::string& e : laterErrors) {
    EXPECT_NE(e.find("the TensorBoard event file " + path +
                     " takes no more records: an earlier write failed"),
              std::string::npos)
        << e;
  }
  const auto size = std::filesystem::file_size(path);
  EXPECT_LE(size, 4000u);
  const auto records = checkedRecords(path);  // fails on a torn record
  ASSERT_GE(records.size(), 2u);
  EXPECT_EQ(field(records[0], 3).bytes, "brain.Event:2");
  for (size_t i = 1; i < records.size(); ++i) {
    EXPECT_EQ(static_cast<int64_t>(field(records[i], 2).value), static_cast<int64_t>(i));
  }
  removeTree(dir);
}

// Records wait in memory until flush(), or until an add comes more than 2 s after the
// last flush, which writes them all (as the header says).
TEST(TensorBoardWriter, AnAddMoreThan2sAfterTheLastFlushWritesWhatWaits) {
  const std::string dir = hddp::testing::makeTempDir();
  hddp::TensorBoardWriter tb(dir);
  tb.addScalar("train/loss", 1.0, 1);
  EXPECT_EQ(checkedRecords(tb.path()).size(), 1u);  // buffered: within 2 s of the first flush
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));
  tb.addScalar("train/loss", 0.5, 2);
  EXPECT_EQ(checkedRecords(tb.path()).size(), 3u);
  tb.addScalar("train/loss", 0.25, 3);
  EXPECT_EQ(checkedRecords(tb.path()).size(), 3u);
  tb.flush();
  EXPECT_EQ(checkedRecords(tb.path()).size(), 4u);
  removeTree(dir);
}

#else

TEST(TensorBoardWriter, RefusedWithoutProtobuf) {
  try {
    hddp::TensorBoardWriter tb(hddp::testing::makeTempDir());
    FAIL() << "a writer was made by an hddp built without protobuf";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("libprotobuf-dev"), std::string::npos) << e.what();
  }
  GTEST_SKIP() << "this hddp was built without protobuf: no event files to check";
}

#endif

}  // namespace
