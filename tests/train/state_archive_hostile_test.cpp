// LibTorch archives built to hurt (a Trainer state file's payload and the archives inside
// it): checkTorchArchive refuses each claim LibTorch's loader would believe beyond the
// bytes present, with a StateError naming the file and the claim, and lets hddp's own
// archives through. The archives are torch::serialize::OutputArchive's, edited and
// written again by LibTorch's zip writer.
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <sstream>
#include <string>

#include "hddp/core/error.h"
#include "train/archive_check.h"

namespace {

using hddp::train::checkTorchArchive;
using Edit = std::function<std::string(const std::string&)>;

// An archive as the Trainer writes them: tensors (w, a float storage of 24 bytes in
// data/0) and an archive inside.
std::string sample() {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive inner;
  archive.write("w", torch::arange(6, torch::kFloat));
  archive.write("step", torch::tensor({int64_t{7}}, torch::kLong));
  inner.write("t", torch::ones({2, 2}));
  archive.write("inner", inner);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

// `bytes` with record `name` passed through `edit` (added when absent), written again.
std::string edited(const std::string& bytes, const std::string& name, const Edit& edit) {
  std::istringstream in(bytes);
  caffe2::serialize::PyTorchStreamReader reader(&in);
  std::ostringstream out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    return n;
  });
  bool found = false;
  for (const auto& record : reader.getAllRecords()) {
    if (record == "version" || record == "byteorder" || record.rfind(".data/", 0) == 0) {
      continue;  // the writer adds its own
    }
    auto [data, size] = reader.getRecord(record);
    std::string content(static_cast<const char*>(data.get()), size);
    if (record == name) {
      content = edit(content);
      found = true;
    }
    writer.writeRecord(record, content.data(), content.size());
  }
  if (!found) {
    const std::string content = edit("");
    writer.writeRecord(name, content.data(), content.size());
  }
  writer.writeEndOfFile();
  return out.str();
}

// `pickle` with its first `from` replaced by `to` (which must be there).
Edit replacing(const std::string& from, const std::string& to) {
  return [from, to](const std::string& pickle) {
    std::string out = pickle;
    const size_t at = out.find(from);
    EXPECT_NE(at, std::string::npos) << "the pickle has no " << from;
    return at == std::string::npos ? out : out.replace(at, from.size(), to);
  };
}

std::string refusal(const std::string& bytes) {
  try {
    checkTorchArchive(bytes, "state file /x/state-00000001.hddp");
  } catch (const hddp::StateError& e) {
    return e.what_without_backtrace();
  }
  return "(no StateError)";
}

std::string bin(const char* bytes, size_t n) { return std::string(bytes, n); }

TEST(StateArchiveHostile, HddpsOwnArchivesPassAndLoad) {
  const std::string bytes = sample();
  EXPECT_NO_THROW(checkTorchArchive(bytes, "sample"));
  const std::string again = edited(bytes, "data.pkl", [](const std::string& p) { return p; });
  EXPECT_NO_THROW(checkTorchArchive(again, "sample written again"));
  torch::serialize::InputArchive archive;
  archive.load_from(again.data(), again.size());
  at::Tensor w;
  archive.read("w", w);
  EXPECT_TRUE(w.equal(torch::arange(6, torch::kFloat)));
}

// Each edit of data.pkl is a claim LibTorch's unpickler believes: it would allocate 32 GB
// for the memo, 2 GB for the string, read 28 bytes from a record of 24, view 7 elements of
// a storage of 6, recurse 2000 levels freeing the tuples, underflow its stack, read a
// dict's last key without a value, call os.system.
TEST(StateArchiveHostile, PickleClaimsBeyondTheBytesAreRefused) {
  const std::string bytes = sample();
  const std::string protocol = bin("\x80\x02", 2);
  const std::vector<std::pair<Edit, std::string>> cases = {
      {replacing(bin("q\x00", 2), bin("r\xff\xff\xff\x7f", 5)), "stores memo 2147483647"},
      {replacing("X", bin("X\xff\xff\xff\x7f", 5)), "claims 2147483647 bytes where"},
      {replacing(bin("K\x06tQ", 4), bin("K\x07tQ", 4)),
       "claims 7 elements of Float (28 bytes) in data/0, which holds 24 bytes"},
      {replacing(bin("(K\x06t(K\x01t", 8), bin("(K\x07t(K\x01t", 8)),
       "must lie within its storage"},
      {[&](const std::string&) { return protocol + ")" + std::string(2000, '\x85') + "."; },
       "values nest 1001 deep"},
      {[&](const std::string&) { return protocol + "(\x85."; }, "from below its MARK"},
      {[&](const std::string&) { return protocol + "}(K\x01u."; }, "a key without a value"},
      {[&](const std::string&) { return protocol + "cos\nsystem\n."; }, "calls os.system"},
  };
  for (const auto& [edit, claim] : cases) {
    const std::string message = refusal(edited(bytes, "data.pkl", edit));
    EXPECT_NE(message.find(claim), std::string::npos) << message;
    EXPECT_NE(message.find("/x/state-00000001.hddp: its pickle data.pkl"), std::string::npos)
        << message;
  }
}

// One storage read again and again (each BINPERSID reads its record anew): 24 bytes 200
// times, more than the whole archive.
TEST(StateArchiveHostile, StoragesReadBeyondTheArchivesSizeAreRefused) {
  const std::string bytes = sample();
  const std::string message = refusal(edited(bytes, "data.pkl", [](const std::string&) {
    std::string p =
        bin("\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x00"
            "0X\x03\x00\x00\x00"
            "cpuK\x06tq\x00",
            54);
    for (int i = 0; i < 200; ++i) {
      p += bin("h\x00Q", 3);
    }
    return p + ".";
  }));
  EXPECT_NE(message.find("storages read more bytes than the archive holds"), std::string::npos)
      << message;
}

// The archive's code: a class with a function (LibTorch runs a __setstate__ while it
// loads), brackets nested past the parser's bound, and the legacy format's model.json.
TEST(StateArchiveHostile, CodeThatRunsOrNestsDeepIsRefused) {
  const std::string bytes = sample();
  const auto appending = [](const std::string& text) {
    return [text](const std::string& code) { return code + text; };
  };
  EXPECT_NE(refusal(edited(bytes, "code/__torch__.py",
                           appending("  def __setstate__(self, state: int) -> None:\n"
                                     "    pass\n")))
                .find("is none of the lines hddp's archives hold"),
            std::string::npos);
  EXPECT_EQ(refusal(edited(bytes, "code/__torch__.py", appending("  # def in a comment\n"))),
            "(no StateError)");
  EXPECT_NE(
      refusal(edited(bytes, "code/__torch__.py", appending("  x = " + std::string(40, '[') + "\n")))
          .find("(  x = [[[["),
      std::string::npos);
  EXPECT_NE(refusal(edited(bytes, "model.json", [](const std::string&) { return "{}"; }))
                .find("model.json"),
            std::string::npos);
}

}  // namespace

namespace {

// An expanded buffer (stride 0: 12 elements viewing a storage of 1), which LibTorch saves
// and loads as a view, and tensors of the newer dtypes: the check lets them through.
TEST(StateArchiveHostile, ExpandedBuffersAndNewerDtypesPassAndLoad) {
  torch::serialize::OutputArchive archive;
  archive.write("expanded", torch::ones({1}).expand({4, 3}), /*is_buffer=*/true);
  archive.write("e8m0", torch::ones({3}).to(torch::kFloat8_e8m0fnu), /*is_buffer=*/true);
  archive.write("u16", torch::ones({3}).to(torch::kUInt16), /*is_buffer=*/true);
  std::ostringstream out;
  archive.save_to(out);
  const std::string bytes = out.str();
  EXPECT_EQ(refusal(bytes), "(no StateError)");
  torch::serialize::InputArchive in;
  in.load_from(bytes.data(), bytes.size());
  at::Tensor expanded;
  in.read("expanded", expanded, /*is_buffer=*/true);
  EXPECT_TRUE(expanded.equal(torch::ones({4, 3})));
  at::Tensor e8m0;
  in.read("e8m0", e8m0, /*is_buffer=*/true);
  EXPECT_EQ(e8m0.scalar_type(), torch::kFloat8_e8m0fnu);
}

// Code lines LibTorch's parser would recurse on once per character: refused by line, not
// a crash. Archives nested three deep still pass.
TEST(StateArchiveHostile, CodeOutsideTheAttributeGrammarIsRefused) {
  const std::string bytes = sample();
  const auto appending = [](const std::string& text) {
    return [text](const std::string& code) { return code + text; };
  };
  for (const std::string& line : {"  __buffers__ = " + std::string(300000, '-') + "1\n",
                                  "  x = " +
                                      [] {
                                        std::string s;
                                        for (int i = 0; i < 100000; ++i) {
                                          s += "not ";
                                        }
                                        return s;
                                      }() +
                                      "1\n",
                                  std::string("  w : Tensor = 1\n")}) {
    const std::string message = refusal(edited(bytes, "code/__torch__.py", appending(line)));
    EXPECT_NE(message.find("its code code/__torch__.py line "), std::string::npos) << message;
    EXPECT_NE(message.find("is none of the lines hddp's archives hold"), std::string::npos)
        << message;
  }
  torch::serialize::OutputArchive outer;
  torch::serialize::OutputArchive middle;
  torch::serialize::OutputArchive inner;
  inner.write("t", torch::ones({2}), /*is_buffer=*/true);
  inner.write("p", torch::ones({2}));
  middle.write("inner", inner);
  middle.write("b", torch::zeros({1}), /*is_buffer=*/true);
  outer.write("middle", middle);
  outer.write("w", torch::ones({1}));
  std::ostringstream out;
  outer.save_to(out);
  EXPECT_EQ(refusal(out.str()), "(no StateError)");
}

// A global's name of a megabyte, which each REDUCE would compare again, and a pickle
// beyond the bound of what checking it may take.
TEST(StateArchiveHostile, LongGlobalNamesAndHugePicklesAreRefused) {
  const std::string bytes = sample();
  const std::string message = refusal(edited(bytes, "data.pkl", [](const std::string&) {
    return bin("\x80\x02", 2) + "c__torch__\n" + std::string(1 << 20, 'M') + "\n.";
  }));
  EXPECT_NE(message.find("a GLOBAL's name of 1048585 bytes, beyond hddp's limit of 4096"),
            std::string::npos)
      << message;
  uint64_t budget = 0;
  try {
    hddp::train::checkArchivePickle(
        std::string(hddp::train::kMaxArchivePickleBytes + 1, '.'), "data.pkl", "data/",
        [](const std::string&) { return std::nullopt; }, budget, "state file /x");
    ADD_FAILURE() << "no StateError";
  } catch (const hddp::StateError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("beyond hddp's limit of 67108864"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
