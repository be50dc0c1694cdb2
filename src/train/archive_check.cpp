// LibTorch's archives checked before LibTorch reads them (train/archive_check.h): the zip,
// then each record LibTorch's loader interprets (pickles, code), read through LibTorch's
// own zip reader once the zip's claimed sizes are known to fit the file.
#include "train/archive_check.h"

#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cctype>
#include <sstream>
#include <vector>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "train/torch_pickle.h"

namespace hddp {
namespace train {

namespace {

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool isIdentStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool isIdentChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The line's text from `i` on, as the cursor of a small parser of it.
struct LineCursor {
  const std::string& s;
  size_t i;
  void spaces() {
    while (i < s.size() && s[i] == ' ') {
      ++i;
    }
  }
  bool eat(const std::string& token) {
    spaces();
    if (s.compare(i, token.size(), token) != 0) {
      return false;
    }
    i += token.size();
    return true;
  }
  bool ident() {
    spaces();
    if (i >= s.size() || !isIdentStart(s[i])) {
      return false;
    }
    while (i < s.size() && isIdentChar(s[i])) {
      ++i;
    }
    return true;
  }
  bool dotted() {  // a.b.c
    if (!ident()) {
      return false;
    }
    while (i < s.size() && s[i] == '.') {
      ++i;
      if (!ident()) {
        return false;
      }
    }
    return true;
  }
  bool string() {  // "..." on one line, with backslash escapes
    spaces();
    if (i >= s.size() || s[i] != '"') {
      return false;
    }
    for (++i; i < s.size() && s[i] != '"'; ++i) {
      i += s[i] == '\\' ? 1 : 0;
    }
    return i++ < s.size();
  }
  bool atEnd() {
    spaces();
    return i == s.size();
  }
  // A type: Name, a.b.Name, Name[Type, ...], nested at most kMaxArchiveCodeNesting deep
  // (iterative: no recursion on the file's bytes).
  bool type() {
    size_t depth = 0;
    for (;;) {
      if (!dotted()) {
        return false;
      }
      if (eat("[")) {
        if (++depth > kMaxArchiveCodeNesting) {
          return false;
        }
        continue;
      }
      while (depth > 0 && eat("]")) {
        --depth;
      }
      if (depth == 0) {
        return true;
      }
      if (!eat(",")) {
        return false;
      }
    }
  }
  bool stringList() {  // ["a", "b", ] or []
    if (!eat("[")) {
      return false;
    }
    while (!eat("]")) {
      if (!string() || !eat(",")) {
        return false;
      }
    }
    return true;
  }
};

// One line of a class file as LibTorch's OutputArchive writes it (attributes only).
bool archiveCodeLine(const std::string& line) {
  LineCursor c{line, 0};
  if (c.atEnd() || line[c.i] == '#') {
    return true;  // blank, or a comment
  }
  if (line[0] != ' ') {  // top level: imports and class headers
    LineCursor imp = c;
    if (imp.eat("import ") && imp.dotted() && imp.atEnd()) {
      return true;
    }
    LineCursor from = c;
    if (from.eat("from ") && from.dotted() && from.eat("import ") && from.ident()) {
      while (from.eat(",")) {
        if (!from.ident()) {
          return false;
        }
      }
      return from.atEnd();
    }
    return c.eat("class ") && c.ident() && c.eat("(") && c.dotted() && c.eat(")") && c.eat(":") &&
           c.atEnd();
  }
  LineCursor list = c;
  if ((list.eat("__parameters__") || list.eat("__buffers__") || list.eat("__annotations__")) &&
      list.eat("=") && list.stringList() && list.atEnd()) {
    return true;
  }
  LineCursor annotation = c;
  if (annotation.eat("__annotations__[") && annotation.string() && annotation.eat("]") &&
      annotation.eat("=") && annotation.type() && annotation.atEnd()) {
    return true;
  }
  return c.ident() && c.eat(":") && c.type() && c.atEnd();
}

// A class file of the archive (code/**.py, TorchScript's Python syntax): only the lines
// LibTorch's OutputArchive writes (class headers, __parameters__ / __buffers__ / __annotations__
// lists of names, `name : Type` and __annotations__["name"] = Type, imports, comments, blank
// lines). So no function (no __setstate__ that LibTorch would run while loading), and no
// expression for its recursive parser (a line of 300000 '-' overflows its stack).
void checkArchiveCode(const std::string& code, const std::string& name, const std::string& what) {
  size_t lineNumber = 0;
  for (size_t begin = 0; begin < code.size();) {
    const size_t end = std::min(code.find('\n', begin), code.size());
    std::string line = code.substr(begin, end - begin);
    if (!line.empty() && line.back() == '\r') {
      line.pop_back();
    }
    ++lineNumber;
    HDDP_CHECK_AS(StateError, archiveCodeLine(line), what, ": its code ", name, " line ",
                  lineNumber, " (", line.substr(0, 64), line.size() > 64 ? "..." : "",
                  ") is none of the lines hddp's archives hold (a class's attributes, nested "
                  "at most ",
                  kMaxArchiveCodeNesting,
                  " deep): LibTorch would parse or run it. The file was not written by hddp");
    begin = end + 1;
  }
}

}  // namespace

void checkPickleSize(uint64_t size, const std::string& name, const std::string& what) {
  HDDP_CHECK_AS(StateError, size <= kMaxArchivePickleBytes, what, ": its pickle ", name, " has ",
                size, " bytes, beyond hddp's limit of ", kMaxArchivePickleBytes,
                " (checking it would take some 140 bytes of memory a byte). Resume from an "
                "earlier state file; this one is damaged or was not written by hddp");
}

void checkTorchArchive(const std::string& bytes, const std::string& what) {
  checkZipEntrySizes(bytes, what);  // before LibTorch's zip reader allocates any entry
  try {
    std::istringstream in(bytes);
    caffe2::serialize::PyTorchStreamReader archive(&in);
    const auto recordSize = [&archive](const std::string& name) -> std::optional<uint64_t> {
      if (!archive.hasRecord(name)) {
        return std::nullopt;
      }
      return archive.getRecordSize(name);
    };
    const auto record = [&archive](const std::string& name) {
      auto [data, size] = archive.getRecord(name);
      return std::string(static_cast<const char*>(data.get()), size);
    };
    std::vector<std::string> names = archive.getAllRecords();
    std::sort(names.begin(), names.end());  // messages the same whatever the zip's order
    HDDP_CHECK_AS(StateError, !archive.hasRecord("model.json"), what,
                  " is an archive of LibTorch before 1.4 (model.json), which hddp does not read");
    // Every storage read, from every pickle, counts against the file's size: each is read
    // from its record once per BINPERSID that names it.
    uint64_t storageBudget = bytes.size();
    for (const auto& name : names) {
      if (endsWith(name, ".pkl") || endsWith(name, ".debug_pkl")) {  // before reading it
        checkPickleSize(archive.getRecordSize(name), name, what);
      }
      if (endsWith(name, ".py")) {
        checkArchiveCode(record(name), name, what);
      } else if (endsWith(name, ".pkl")) {  // data.pkl's storages are in data/, and so on
        checkArchivePickle(record(name), name, name.substr(0, name.size() - 4) + "/", recordSize,
                           storageBudget, what);
      } else if (endsWith(name, ".debug_pkl")) {  // source ranges for messages: no tensors
        checkArchivePickle(record(name), name, "", recordSize, storageBudget, what);
      }
    }
  } catch (const StateError&) {
    throw;
  } catch (const c10::Error& e) {  // the zip reader's own complaints
    rethrowIfOutOfMemory();        // but memory is no fault of the file's
    HDDP_THROW(StateError, what, " holds no readable archive (", e.what_without_backtrace(), ")");
  } catch (const std::exception& e) {
    rethrowIfOutOfMemory();
    HDDP_THROW(StateError, what, " holds no readable archive (", e.what(), ")");
  }
}

}  // namespace train
}  // namespace hddp
