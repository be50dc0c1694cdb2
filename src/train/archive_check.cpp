// LibTorch's archives checked before LibTorch reads them (train/archive_check.h): the zip,
// then each record LibTorch's loader interprets (pickles, code), read through LibTorch's
// own zip reader once the zip's claimed sizes are known to fit the file.
#include "train/archive_check.h"

#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cctype>
#include <sstream>
#include <vector>

#include "hddp/core/error.h"
#include "train/torch_pickle.h"

namespace hddp {
namespace train {

namespace {

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A class file of the archive (code/**.py, TorchScript's Python syntax): no function, so no
// __setstate__ that LibTorch would run while loading, and brackets nested within the
// parser's bound. Strings and comments are skipped: only code counts.
void checkArchiveCode(const std::string& code, const std::string& name, const std::string& what) {
  size_t depth = 0;
  for (size_t i = 0; i < code.size(); ++i) {
    const char c = code[i];
    if (c == '#') {  // a comment, to the end of its line
      i = std::min(code.find('\n', i), code.size());
    } else if (c == '"' || c == '\'') {  // a string, to its closing quote
      for (++i; i < code.size() && code[i] != c && code[i] != '\n'; ++i) {
        i += code[i] == '\\' ? 1 : 0;
      }
    } else if (c == '(' || c == '[' || c == '{') {
      HDDP_CHECK_AS(StateError, ++depth <= kMaxArchiveCodeNesting, what, ": its code ", name,
                    " nests brackets more than ", kMaxArchiveCodeNesting, " deep at byte ", i,
                    "; hddp's archives nest them 2 deep");
    } else if ((c == ')' || c == ']' || c == '}') && depth > 0) {
      --depth;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = i;
      while (end < code.size() &&
             (std::isalnum(static_cast<unsigned char>(code[end])) || code[end] == '_')) {
        ++end;
      }
      HDDP_CHECK_AS(StateError, code.compare(i, end - i, "def") != 0, what, ": its code ", name,
                    " defines a function (at byte ", i,
                    "): hddp's archives hold attributes only, and LibTorch would run a class's "
                    "__setstate__ while loading. The file was not written by hddp");
      i = end - 1;
    }
  }
}

}  // namespace

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
    HDDP_THROW(StateError, what, " holds no readable archive (", e.what_without_backtrace(), ")");
  } catch (const std::exception& e) {
    HDDP_THROW(StateError, what, " holds no readable archive (", e.what(), ")");
  }
}

}  // namespace train
}  // namespace hddp
