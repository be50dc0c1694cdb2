// State dict files built to hurt (#48): each reader refuses what the file does not hold
// with a StateError naming the file and the claim, before allocating it, and nothing
// the file nests crashes the process. The files are built here, from hddp's own writer's
// output; torch.load(weights_only=True) reads the nested pickles and the tied one
// (checked by hand with the torch wheel; this test needs no Python).
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <torch/torch.h>

#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <sstream>

#include "hddp/core/error.h"
#include "hddp/train/state_dict.h"
#include "support/ranks.h"
#include "train/pickle_reader.h"
#include "train/torch_pickle.h"

namespace {

// A string literal with its NUL bytes (pickles are full of them).
template <size_t N>
std::string bin(const char (&literal)[N]) {
  return std::string(literal, N - 1);
}

void writeBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A torch.save file of {"w": [0, 1, 2, 3, 4, 5] as float}, its data.pkl passed through
// `edit`; the zip is written again by LibTorch's writer, as torch.save writes it.
std::string savedWith(const std::function<std::string(const std::string&)>& edit) {
  const std::string pt = hddp::train::torchSaveBytes({{"w", torch::arange(6, torch::kFloat)}});
  std::istringstream in(pt);
  caffe2::serialize::PyTorchStreamReader reader(&in);
  std::ostringstream out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
    return n;
  });
  for (const auto& name : reader.getAllRecords()) {
    if (name == "version" || name.rfind(".data/", 0) == 0) {
      continue;  // the writer adds its own
    }
    auto [data, size] = reader.getRecord(name);
    std::string bytes(static_cast<const char*>(data.get()), size);
    if (name == "data.pkl") {
      bytes = edit(bytes);
    }
    writer.writeRecord(name, bytes.data(), bytes.size());
  }
  writer.writeEndOfFile();
  return out.str();
}

// `before` replaced by `after` in a pickle, once; the test fails if `before` is absent.
std::string replaced(std::string pickle, const std::string& before, const std::string& after) {
  const size_t at = pickle.find(before);
  EXPECT_NE(at, std::string::npos) << "the writer's pickle changed; update this test";
  return at == std::string::npos ? pickle : pickle.replace(at, before.size(), after);
}

// A LONG1 opcode of 8 bytes: the pickle of a large integer.
std::string long1(int64_t v) {
  std::string out = "\x8a\x08";
  out.append(reinterpret_cast<const char*>(&v), 8);  // little-endian hosts, as the writer
  return out;
}

// The message of the StateError `read` throws ("" and a failure if it throws none).
std::string stateErrorOf(const std::function<void()>& read) {
  try {
    read();
  } catch (const hddp::StateError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a StateError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "the file was read";
  return "";
}

// Runs `f` on a thread with a stack of `bytes` and rethrows what it threw: a reader that
// recurses once per level of the file's nesting overflows it and ends the process.
void onSmallStack(size_t bytes, const std::function<void()>& f) {
  struct Call {
    const std::function<void()>* f;
    std::exception_ptr error;
  } call{&f, nullptr};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, bytes);
  pthread_t thread;
  const int made = pthread_create(
      &thread, &attr,
      [](void* p) -> void* {
        auto* c = static_cast<Call*>(p);
        try {
          (*c->f)();
        } catch (...) {
          c->error = std::current_exception();
        }
        return nullptr;
      },
      &call);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(made, 0);
  pthread_join(thread, nullptr);
  if (call.error) {
    std::rethrow_exception(call.error);
  }
}

// The pickle with `tuples` TUPLE1 opcodes wrapping a None before the dict: a chain of
// nested 1-tuples left on the stack below it, which STOP leaves alone.
std::string nestedBy(size_t tuples) {
  return savedWith([&](const std::string& p) {
    return p.substr(0, 2) + "N" + std::string(tuples, '\x85') + p.substr(2);
  });
}

TEST(StateDictHostile, APickleNestedBeyondTheLimitIsRefusedNamingTheDepthNotACrash) {
  const std::string path = hddp::testing::makeTempDir() + "/nested300000.pt";
  writeBytes(path, nestedBy(300000));  // 301 KB; torch.load reads it
  const std::string m = stateErrorOf([&] { hddp::readStateDict(path); });
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find("nests values " + std::to_string(hddp::train::kMaxPickleDepth + 1) + " deep"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("limit of " + std::to_string(hddp::train::kMaxPickleDepth)), std::string::npos)
      << m;
}

TEST(StateDictHostile, APickleNestedWithinTheLimitLoadsAndIsTornDownWithoutRecursion) {
  const std::string path = hddp::testing::makeTempDir() + "/nested4000.pt";
  ASSERT_LT(4000u, hddp::train::kMaxPickleDepth);
  writeBytes(path, nestedBy(4000));
  // 4000 levels torn down recursively take several times this stack.
  std::map<std::string, at::Tensor> file;
  onSmallStack(256 * 1024, [&] { file = hddp::readStateDict(path); });
  ASSERT_EQ(file.count("w"), 1u);
  EXPECT_TRUE(file.at("w").equal(torch::arange(6, torch::kFloat)));
}

TEST(StateDictHostile, ATorchSaveStorageClaimingMoreThanItsRecordIsRefusedBeforeAllocating) {
  const std::string dir = hddp::testing::makeTempDir();
  // The storage's element count, 6, becomes 2^40 (4 TiB of float).
  writeBytes(dir + "/storage.pt", savedWith([](const std::string& p) {
               return replaced(p, bin("cpuK\x06t"), "cpu" + long1(int64_t{1} << 40) + "t");
             }));
  std::string m = stateErrorOf([&] { hddp::readStateDict(dir + "/storage.pt"); });
  EXPECT_NE(m.find(dir + "/storage.pt"), std::string::npos) << m;
  EXPECT_NE(m.find("'w' claims 1099511627776 elements of Float (4398046511104 bytes) in data/0, "
                   "which holds 24 bytes"),
            std::string::npos)
      << m;
  // A view of size [2^40, 2^20] and stride [0, 0] over the 6 floats: 4.6 EB to copy.
  writeBytes(dir + "/view.pt", savedWith([](const std::string& p) {
               return replaced(p, bin("(K\x06t(K\x01t"),
                               "(" + long1(int64_t{1} << 40) + long1(int64_t{1} << 20) +
                                   bin("t(K\x00K\x00t"));
             }));
  m = stateErrorOf([&] { hddp::readStateDict(dir + "/view.pt"); });
  EXPECT_NE(m.find("'w' claims 4611686018427387904 bytes (size [1099511627776, 1048576]"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("which holds 24 bytes"), std::string::npos) << m;
  // A view past the end of its storage, and a negative size.
  writeBytes(dir + "/past.pt", savedWith([](const std::string& p) {
               return replaced(p, bin("QK\x00(K\x06t"), bin("QK\x01(K\x06t"));
             }));
  m = stateErrorOf([&] { hddp::readStateDict(dir + "/past.pt"); });
  EXPECT_NE(m.find("'w' claims 24 bytes (size [6], stride [1], storage offset 1"), std::string::npos)
      << m;
  writeBytes(dir + "/negative.pt", savedWith([](const std::string& p) {
               return replaced(p, bin("(K\x06t("), "(" + long1(-6) + "t(");
             }));
  m = stateErrorOf([&] { hddp::readStateDict(dir + "/negative.pt"); });
  EXPECT_NE(m.find("'w' has size [-6]"), std::string::npos) << m;
}

// The central directory's sizes of the entry whose name ends with `suffix`, set to `size`.
std::string withEntrySize(std::string zip, const std::string& suffix, uint32_t size) {
  bool found = false;
  for (size_t at = zip.find("PK\x01\x02"); at != std::string::npos;
       at = zip.find("PK\x01\x02", at + 4)) {
    uint16_t nameLength = 0;
    std::memcpy(&nameLength, zip.data() + at + 28, 2);
    const std::string name = zip.substr(at + 46, nameLength);
    if (name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      std::memcpy(&zip[at + 20], &size, 4);  // compressed
      std::memcpy(&zip[at + 24], &size, 4);  // uncompressed
      found = true;
    }
  }
  EXPECT_TRUE(found) << suffix;
  return zip;
}

TEST(StateDictHostile, AZipEntryClaimingMoreThanTheFileIsRefusedBeforeAllocating) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string pt = hddp::train::torchSaveBytes({{"w", torch::arange(6, torch::kFloat)}});
  for (const std::string entry : {"/data/0", "/version"}) {
    const std::string path = dir + "/entry" + std::to_string(entry.size()) + ".pt";
    writeBytes(path, withEntrySize(pt, entry, 0x7fffffff));
    const std::string m = stateErrorOf([&] { hddp::readStateDict(path); });
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find(entry + " claims 2147483647 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("more than the whole file's " + std::to_string(pt.size())), std::string::npos)
        << m;
  }
}

// A safetensors file: `header` as its JSON header, then `data`.
std::string safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(&out[0], &n, 8);
  return out + header + data;
}

TEST(StateDictHostile, ASafetensorsShapeOfExabytesIsRefusedBeforeAllocating) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string data(24, '\0');
  const auto messageOf = [&](const std::string& name, const std::string& header) {
    writeBytes(dir + "/" + name, safetensors(header, data));
    return stateErrorOf([&] { hddp::readStateDict(dir + "/" + name); });
  };
  std::string m = messageOf(
      "huge.safetensors",
      R"({"w":{"dtype":"F32","shape":[1099511627776,1048576],"data_offsets":[0,24]}})");
  EXPECT_NE(m.find(dir + "/huge.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("'w' of shape [1099511627776, 1048576] and dtype F32 claims "
                   "4611686018427387904 bytes, the file holds 24 bytes for it"),
            std::string::npos)
      << m;
  m = messageOf("overflow.safetensors",
                R"({"w":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,24]}})");
  EXPECT_NE(m.find("claims more than 2^64 bytes"), std::string::npos) << m;
  m = messageOf("negative.safetensors",
                R"({"w":{"dtype":"F32","shape":[-1,6],"data_offsets":[0,24]}})");
  EXPECT_NE(m.find("'w' has a size -1 in its shape"), std::string::npos) << m;
  m = messageOf("outside.safetensors",
                R"({"w":{"dtype":"F32","shape":[6],"data_offsets":[8,32]}})");
  EXPECT_NE(m.find("'w' has data_offsets [8, 32], outside the file's 24 bytes of data"),
            std::string::npos)
      << m;
  // Two tensors over the same bytes: each fits, together they claim twice the data.
  m = messageOf("overlap.safetensors",
                R"({"a":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},)"
                R"("b":{"dtype":"F32","shape":[6],"data_offsets":[0,24]}})");
  EXPECT_NE(m.find("starts at byte 0 of the data, where the tensors before it end at 24"),
            std::string::npos)
      << m;
  // A header nested 200,000 deep is refused without recursing (nlohmann's parser and
  // destructor keep their own stacks; nothing here prints it).
  m = messageOf("deep.safetensors", std::string(200000, '[') + std::string(200000, ']'));
  EXPECT_NE(m.find("not a JSON object"), std::string::npos) << m;
}

TEST(StateDictHostile, TensorsThatShareAStorageAreViewsOfItNotCopies) {
  // Tied weights: two keys, one storage; the file's bytes are read once.
  const std::string path = hddp::testing::makeTempDir() + "/tied.pt";
  writeBytes(path, savedWith([](const std::string& p) {
               // A second entry, "v", viewing elements 2..5 of the same storage data/0.
               const size_t end = p.rfind("u.");
               const std::string rebuild = p.substr(p.find("ctorch._utils"));
               std::string v = bin("X\x01\x00\x00\x00v") + rebuild.substr(0, rebuild.rfind("u."));
               v = replaced(v, bin("QK\x00(K\x06t"), bin("QK\x02(K\x04t"));
               return p.substr(0, end) + v + "u.";
             }));
  const auto file = hddp::readStateDict(path);
  ASSERT_EQ(file.size(), 2u);
  EXPECT_TRUE(file.at("v").equal(torch::arange(2, 6, torch::kFloat)));
  EXPECT_EQ(file.at("v").data_ptr<float>(), file.at("w").data_ptr<float>() + 2);
}

}  // namespace
