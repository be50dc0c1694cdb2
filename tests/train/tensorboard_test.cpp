// TensorBoard event files: CRC-32C against published vectors, the record framing and
// the Event messages byte for byte against what TensorBoard's own Python writer and
// protos produce, a writer's file read back record by record (lengths, both CRCs, the
// fields by TensorFlow's numbers), its flushes and failures; and the Trainer's
// TensorBoard on several ranks: a folder rank 0 cannot write, a full disk mid-run, the
// learning rate of any optimizer.
#include "hddp/train/tensorboard.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"

#if HDDP_TEST_TENSORBOARD
#include "train/event_file.h"
#include "train/reporter.h"
#endif

namespace {

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

// One rank of a small Trainer run (a linear classifier on 8x8 synthetic images, 4 steps
// an epoch, SGD unless `makeOptimizer` is given) whose collectives give up after 30 s,
// so that a rank left waiting fails the test instead of hanging it.
hddp::TrainSummary trainLinear(int rank, int size, hddp::Store& store,
                               const std::function<void(hddp::TrainerOptions&)>& configure,
                               const OptimizerFactory& makeOptimizer = nullptr) {
  hddp::CommunicatorOptions co;
  co.timeout = std::chrono::seconds(30);
  auto comm = hddp::makeCommunicator(store, rank, size, co);
  torch::manual_seed(7);
  torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 4));
  std::unique_ptr<torch::optim::Optimizer> optimizer =
      makeOptimizer ? makeOptimizer(model->parameters())
                    : std::make_unique<torch::optim::SGD>(model->parameters(),
                                                          torch::optim::SGDOptions(0.05));
  hddp::TrainerOptions o;
  o.globalBatch = 24;
  o.epochs = 2;
  o.balance = false;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 0;
  configure(o);
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
  hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(),
                        *optimizer, ds, o);
  return trainer.fit();
}

#if HDDP_TEST_TENSORBOARD

// A full disk for this process while in scope: files grow to `bytes` at most
// (RLIMIT_FSIZE), and a write past that fails with EFBIG instead of raising SIGXFSZ.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) : oldHandler_(std::signal(SIGXFSZ, SIG_IGN)) {
    EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &old_), 0);
    struct rlimit small = old_;
    small.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, oldHandler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  struct rlimit old_ {};
  void (*oldHandler_)(int);
};

// Gradient descent with options of its own: an optimizer LibTorch does not ship. With
// `kKnowsItsRate` its options override get_lr()/set_lr(), as LibTorch's own do; without,
// they keep OptimizerOptions' (which throw).
template <bool kKnowsItsRate>
struct PlainDescentOptions
    : torch::optim::OptimizerCloneableOptions<PlainDescentOptions<kKnowsItsRate>> {
  explicit PlainDescentOptions(double rate) : rate(rate) {}
  double rate;
};

template <>
struct PlainDescentOptions<true>
    : torch::optim::OptimizerCloneableOptions<PlainDescentOptions<true>> {
  explicit PlainDescentOptions(double rate) : rate(rate) {}
  double get_lr() const override { return rate; }
  void set_lr(const double lr) override { rate = lr; }
  double rate;
};

template <bool kKnowsItsRate>
class PlainDescent : public torch::optim::Optimizer {
 public:
  PlainDescent(std::vector<at::Tensor> params, double rate)
      : Optimizer(std::move(params), std::make_unique<PlainDescentOptions<kKnowsItsRate>>(rate)) {}
  at::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard noGrad;
    for (auto& group : param_groups()) {
      const double rate = static_cast<PlainDescentOptions<kKnowsItsRate>&>(group.options()).rate;
      for (auto& p : group.params()) {
        if (p.grad().defined()) {
          p.add_(p.grad(), -rate);
        }
      }
    }
    return {};
  }
};

using hddp::train::crc32c;
using hddp::train::frameRecord;
using hddp::train::maskedCrc32c;
namespace events = hddp::train::events;

std::string hex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

uint32_t crcOf(const std::string& s) { return crc32c(s.data(), s.size()); }

uint64_t readLittleEndian(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<unsigned char>(bytes.at(at + static_cast<size_t>(i)));
  }
  return v;
}

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

// ---- reading a file back: the framing, then the protobuf wire format by hand ----------

struct Field {
  uint64_t number = 0;
  int wire = 0;
  uint64_t value = 0;  // varint, fixed64 or fixed32
  std::string bytes;   // length-delimited
};

uint64_t varint(const std::string& s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    const auto b = static_cast<unsigned char>(s.at(at++));
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0) {
      return v;
    }
  }
  ADD_FAILURE() << "varint too long";
  return v;
}

std::vector<Field> fields(const std::string& message) {
  std::vector<Field> out;
  size_t at = 0;
  while (at < message.size()) {
    Field f;
    const uint64_t key = varint(message, at);
    f.number = key >> 3;
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.value = varint(message, at);
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      f.value = readLittleEndian(message, at, n);
      at += static_cast<size_t>(n);
    } else if (f.wire == 2) {
      const uint64_t n = varint(message, at);
      f.bytes = message.substr(at, n);
      EXPECT_EQ(f.bytes.size(), n) << "truncated field " << f.number;
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      return out;
    }
    out.push_back(f);
  }
  return out;
}

// The one field `number` of `message` (a failure when absent or repeated).
Field field(const std::string& message, uint64_t number) {
  std::vector<Field> found;
  for (const Field& f : fields(message)) {
    if (f.number == number) {
      found.push_back(f);
    }
  }
  EXPECT_EQ(found.size(), 1u) << "field " << number << " in " << hex(message);
  return found.empty() ? Field{} : found.front();
}

bool hasField(const std::string& message, uint64_t number) {
  for (const Field& f : fields(message)) {
    if (f.number == number) {
      return true;
    }
  }
  return false;
}

double asDouble(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

float asFloat(uint64_t bits) {
  const auto b = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// Splits a TFRecord file into its records, checking each length and both CRCs.
std::vector<std::string> readRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string file = buffer.str();
  std::vector<std::string> records;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "a truncated header at byte " << at;
    if (at + 12 > file.size()) {
      break;
    }
    const uint64_t length = readLittleEndian(file, at, 8);
    EXPECT_EQ(readLittleEndian(file, at + 8, 4), maskedCrc32c(file.data() + at, 8))
        << "the length's CRC at byte " << at;
    EXPECT_LE(at + 16 + length, file.size()) << "a truncated record at byte " << at;
    if (at + 16 + length > file.size()) {
      break;
    }
    const std::string data = file.substr(at + 12, length);
    EXPECT_EQ(readLittleEndian(file, at + 12 + length, 4), maskedCrc32c(data.data(), data.size()))
        << "the data's CRC at byte " << at;
    records.push_back(data);
    at += 16 + length;
  }
  return records;
}

std::vector<std::string> eventFiles(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

void removeTree(const std::string& dir) {
  // Not std::filesystem::remove_all (see tests/examples/trainers_test.cpp).
  ASSERT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0) << dir;
}

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

  const auto records = readRecords(path);
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
  EXPECT_EQ(readRecords(tb.path()).size(), 1u);  // the version, flushed by the constructor
  tb.addScalar("train/loss", 1.0, 1);
  tb.flush();
  EXPECT_EQ(readRecords(tb.path()).size(), 2u);
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
  const auto records = readRecords(path);  // fails on a torn record
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
  EXPECT_EQ(readRecords(tb.path()).size(), 1u);  // buffered: within 2 s of the first flush
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));
  tb.addScalar("train/loss", 0.5, 2);
  EXPECT_EQ(readRecords(tb.path()).size(), 3u);
  tb.addScalar("train/loss", 0.25, 3);
  EXPECT_EQ(readRecords(tb.path()).size(), 3u);
  tb.flush();
  EXPECT_EQ(readRecords(tb.path()).size(), 4u);
  removeTree(dir);
}

// ---- the Trainer's TensorBoard ----------------------------------------------------------

// The scalars of `tag` in a folder's event files, as (step, value).
std::vector<std::pair<int64_t, float>> scalarsIn(const std::string& dir, const std::string& tag) {
  std::vector<std::pair<int64_t, float>> out;
  for (const std::string& name : eventFiles(dir)) {
    for (const std::string& e : readRecords(dir + "/" + name)) {
      if (!hasField(e, 5)) {
        continue;
      }
      for (const Field& v : fields(field(e, 5).bytes)) {
        if (v.number == 1 && field(v.bytes, 1).bytes == tag && hasField(v.bytes, 2)) {
          out.emplace_back(static_cast<int64_t>(field(e, 2).value),
                           asFloat(field(v.bytes, 2).value));
        }
      }
    }
  }
  return out;
}

// Rank 0 alone writes TensorBoard: a folder it cannot make (here one under a regular
// file, which stops root too) fails fit() on every rank at once, each with a
// ConfigError that names the folder, instead of leaving rank 1 in the next collective
// until its timeout (30 s here, 30 min by default).
TEST(TrainerTensorBoard, AFolderRank0CannotMakeFailsEveryRankAtOnce) {
  const std::string dir = hddp::testing::makeTempDir();
  std::ofstream(dir + "/a_file") << "not a folder";
  const std::string folder = dir + "/a_file/runs";
  std::vector<std::string> errors(2, "(no ConfigError)");
  const auto start = std::chrono::steady_clock::now();
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      trainLinear(rank, size, store, [&](hddp::TrainerOptions& o) { o.tensorboard = folder; });
    } catch (const hddp::ConfigError& e) {
      errors[rank] = e.what_without_backtrace();
    } catch (const std::exception& e) {
      errors[rank] = std::string("not a ConfigError: ") + e.what();
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[0].find("cannot create the TensorBoard folder " + folder), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("opening the output files at the start of fit() failed on rank 0: "
                           "hddp: cannot create the TensorBoard folder " +
                           folder),
            std::string::npos)
      << errors[1];
  // A ConfigError on both ranks, not a TimeoutError: rank 1 did not wait for rank 0. The
  // time is for the log only (no test requires a speed).
  std::cout << "both ranks failed in " << seconds << " s\n";
  removeTree(dir);
}

// A disk that fills up mid-run (the file size limit, RLIMIT_FSIZE): rank 0 logs an error
// naming the file, writes no more TensorBoard records, and both ranks train to the end
// (a throw on rank 0 alone would leave rank 1 in the next collective). The file keeps
// the whole records written before the failure.
TEST(TrainerTensorBoard, AWriteThatFailsMidRunStopsTensorBoardNotTheRun) {
  const std::string dir = hddp::testing::makeTempDir() + "/tb";
  std::mutex mutex;
  std::vector<std::string> errorLines;
  hddp::log::setLineHandler([&](hddp::log::Level level, const std::string& line) {
    if (level >= hddp::log::Level::Error) {
      std::lock_guard<std::mutex> lock(mutex);
      errorLines.push_back(line);
    }
  });
  std::vector<hddp::TrainSummary> summaries(2);
  std::vector<std::string> errors(2);
  {
    // ~1 KB a step: the limit falls within the run's 8 steps. No other file grows.
    const FileSizeLimit full(3000);
    hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
      try {
        summaries[rank] =
            trainLinear(rank, size, store, [&](hddp::TrainerOptions& o) { o.tensorboard = dir; });
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  hddp::log::setLineHandler(nullptr);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(summaries[r].totalSteps, 8) << "rank " << r;
  }
  const auto files = eventFiles(dir);
  ASSERT_EQ(files.size(), 1u);
  const std::string path = dir + "/" + files[0];
  ASSERT_EQ(errorLines.size(), 1u) << "one error, then TensorBoard is off";
  EXPECT_NE(errorLines[0].find("TENSORBOARD OUTPUT STOPS HERE: hddp: cannot write the "
                               "TensorBoard event file " +
                               path),
            std::string::npos)
      << errorLines[0];
  EXPECT_NE(errorLines[0].find("training goes on"), std::string::npos) << errorLines[0];
  const auto losses = scalarsIn(dir, "train/loss");  // whole records only
  ASSERT_FALSE(losses.empty());
  EXPECT_LT(losses.back().first, 8);
  removeTree(std::filesystem::path(dir).parent_path().string());
}

// train/lr is the first group's rate by its options' get_lr(): written for an optimizer
// LibTorch does not ship (following the schedule, which sets it through set_lr), and
// left out, without failing the run, for one whose options do not implement it.
TEST(TrainerTensorBoard, TheLearningRateOfAnyOptimizerThatKnowsItIsWritten) {
  const std::string dir = hddp::testing::makeTempDir();
  const auto schedule = [](const hddp::StepInfo& info, torch::optim::Optimizer& optimizer) {
    hddp::setLearningRate(optimizer, 0.5 / static_cast<double>(info.step + 1));
  };
  hddp::testing::runThreads(1, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    for (const bool knowsItsRate : {true, false}) {
      torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 4));
      std::unique_ptr<torch::optim::Optimizer> optimizer;
      if (knowsItsRate) {
        optimizer = std::make_unique<PlainDescent<true>>(model->parameters(), 0.5);
      } else {
        optimizer = std::make_unique<PlainDescent<false>>(model->parameters(), 0.5);
      }
      hddp::TrainerOptions o;
      o.globalBatch = 24;
      o.epochs = 2;
      o.balance = false;
      o.progress = hddp::ProgressMode::Off;
      o.loader.workers = 0;
      o.tensorboard = dir + (knowsItsRate ? "/knows" : "/does_not");
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, 1);
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(),
                            *optimizer, ds, o);
      if (knowsItsRate) {
        trainer.setSchedule(schedule);
      }
      EXPECT_EQ(trainer.fit().totalSteps, 8);
    }
  });
  const auto rates = scalarsIn(dir + "/knows", "train/lr");
  ASSERT_EQ(rates.size(), 8u);
  for (const auto& [step, rate] : rates) {
    // StepInfo::step counts the steps done before it; TensorBoard's step includes it.
    EXPECT_EQ(rate, static_cast<float>(0.5 / static_cast<double>(step))) << "step " << step;
  }
  EXPECT_TRUE(scalarsIn(dir + "/does_not", "train/lr").empty());
  EXPECT_EQ(scalarsIn(dir + "/does_not", "train/loss").size(), 8u);
  removeTree(dir);
}

// A step in which rank 0 had no samples has no loss of rank 0's share: no train/loss
// point (it was written as 0, a loss the run never had); the other tags are written.
TEST(TrainerTensorBoard, AStepWithoutSamplesOnRank0WritesNoLoss) {
  const std::string dir = hddp::testing::makeTempDir();
  {
    hddp::train::Reporter reporter("", 0, false, false, false, 1);
    reporter.startTensorBoard(dir, 1);
    for (int64_t step = 1; step <= 3; ++step) {
      hddp::train::StepReport r;
      r.step = step;
      r.globalBatch = 16;
      r.localBatch = step == 2 ? 0 : 8;
      r.plan = {r.localBatch, 16 - r.localBatch};
      r.loss = step == 2 ? 0.0 : 1.5;
      r.stepSeconds = 0.1;
      reporter.step(r);
    }
  }
  const auto loss = scalarsIn(dir, "train/loss");
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_EQ(loss[0].first, 1);
  EXPECT_EQ(loss[1].first, 3);
  EXPECT_EQ(scalarsIn(dir, "share/rank0").size(), 3u);
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

// Without protobuf every rank refuses a TensorBoard folder when the Trainer is made, so
// no rank gets to fit() and waits there for the others.
TEST(TrainerTensorBoard, RefusedOnEveryRankWithoutProtobuf) {
  EXPECT_FALSE(hddp::tensorBoardAvailable());
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<std::string> errors(2, "(no ConfigError)");
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      trainLinear(rank, size, store, [&](hddp::TrainerOptions& o) { o.tensorboard = dir; });
    } catch (const hddp::ConfigError& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("built without protobuf"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find(dir), std::string::npos) << errors[r];
  }
}

#endif

}  // namespace
