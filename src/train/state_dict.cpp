// State dicts Python reads and writes (hddp/train/state_dict.h): LibTorch's pickle
// format and safetensors.
#include "hddp/train/state_dict.h"

#include <fcntl.h>
#include <torch/nn/module.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/torch_pickle.h"

namespace hddp {

namespace {

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool isSafetensors(const std::string& path) { return endsWith(path, ".safetensors"); }

// safetensors' dtype names.
const std::vector<std::pair<std::string, at::ScalarType>>& dtypeNames() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return names;
}

std::string dtypeName(at::ScalarType t, const std::string& key) {
  for (const auto& [name, type] : dtypeNames()) {
    if (type == t) {
      return name;
    }
  }
  HDDP_THROW(ConfigError, "state dict: '", key, "' is of dtype ", t,
             ", which safetensors has no name for here; save it as .pt");
}

void writeFile(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  HDDP_CHECK(fd >= 0, "cannot write ", tmp, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      HDDP_THROW(Error, "writing ", tmp, ": ", why);
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  HDDP_CHECK(synced && std::rename(tmp.c_str(), path.c_str()) == 0, "cannot write ", path, ": ",
             std::strerror(errno));
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  HDDP_CHECK_AS(StateError, in.good(), "cannot open state dict ", path, ": ", std::strerror(errno));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string safetensorsBytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  std::vector<at::Tensor> data;
  for (const auto& [key, tensor] : tensors) {
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const auto bytes = static_cast<int64_t>(t.nbytes());
    header[key] = {{"dtype", dtypeName(t.scalar_type(), key)},
                   {"shape", t.sizes().vec()},
                   {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(t);
  }
  std::string json = header.dump();
  while (json.size() % 8 != 0) {
    json += ' ';  // the data starts 8-byte aligned, as the reference writer pads it
  }
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) {
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  }
  out += json;
  out.reserve(out.size() + static_cast<size_t>(offset));
  for (const auto& t : data) {
    out.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  return out;
}

// One tensor of a safetensors header, checked against the data before it is allocated.
struct SafetensorsEntry {
  std::string key;
  at::ScalarType type = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

SafetensorsEntry safetensorsEntry(const std::string& key, const nlohmann::json& entry,
                                  const std::string& path, uint64_t dataSize) {
  SafetensorsEntry out;
  out.key = key;
  const std::string dtype = entry.at("dtype").get<std::string>();
  bool known = false;
  for (const auto& [name, t] : dtypeNames()) {
    if (name == dtype) {
      out.type = t;
      known = true;
    }
  }
  HDDP_CHECK_AS(StateError, known, "state dict ", path, ": '", key, "' has dtype ", dtype,
                ", which hddp does not read");
  const auto& shape = entry.at("shape");
  HDDP_CHECK_AS(StateError, shape.is_array(), "state dict ", path, ": '", key,
                "' has a shape that is not a list");
  for (const auto& dim : shape) {
    HDDP_CHECK_AS(StateError,
                  dim.is_number_unsigned() && dim.get<uint64_t>() <= uint64_t{INT64_MAX},
                  "state dict ", path, ": '", key, "' has a size ",
                  dim.is_primitive() ? dim.dump() : "that is a list or object",
                  " in its shape, not a whole number from 0 to 2^63 - 1");
    out.shape.push_back(dim.get<int64_t>());
  }
  const auto& range = entry.at("data_offsets");
  HDDP_CHECK_AS(StateError,
                range.is_array() && range.size() == 2 && range[0].is_number_unsigned() &&
                    range[1].is_number_unsigned(),
                "state dict ", path, ": '", key, "' has data_offsets that are not two byte offsets");
  out.begin = range[0].get<uint64_t>();
  out.end = range[1].get<uint64_t>();
  HDDP_CHECK_AS(StateError, out.begin <= out.end && out.end <= dataSize, "state dict ", path,
                ": '", key, "' has data_offsets [", out.begin, ", ", out.end,
                "], outside the file's ", dataSize, " bytes of data");
  const auto claimed = train::tensorBytes(out.shape, c10::elementSize(out.type));
  HDDP_CHECK_AS(StateError, claimed && *claimed == out.end - out.begin, "state dict ", path, ": '",
                key, "' of shape ", c10::IntArrayRef(out.shape), " and dtype ", dtype, " claims ",
                train::bytesText(claimed), ", the file holds ", out.end - out.begin,
                " bytes for it (data_offsets [", out.begin, ", ", out.end, "])");
  return out;
}

std::map<std::string, at::Tensor> fromSafetensors(const std::string& bytes,
                                                  const std::string& path) {
  HDDP_CHECK_AS(StateError, bytes.size() >= 8, "state dict ", path,
                " is too short to be a safetensors file (", bytes.size(), " bytes)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[static_cast<size_t>(i)]))
         << (8 * i);
  }
  HDDP_CHECK_AS(StateError, n <= bytes.size() - 8, "state dict ", path, ": its header claims ", n,
                " bytes, the file has ", bytes.size() - 8, " after the length");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, n));  // iterative: no nesting limit needed
  } catch (const std::exception& e) {
    HDDP_THROW(StateError, "state dict ", path, ": the safetensors header is not JSON: ", e.what());
  }
  HDDP_CHECK_AS(StateError, header.is_object(), "state dict ", path,
                ": the safetensors header is not a JSON object");
  const size_t dataStart = 8 + n;
  const uint64_t dataSize = bytes.size() - dataStart;
  // Every entry is checked before any tensor is allocated.
  std::vector<SafetensorsEntry> entries;
  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") {
      continue;
    }
    try {
      entries.push_back(safetensorsEntry(key, entry, path, dataSize));
    } catch (const nlohmann::json::exception& e) {
      HDDP_THROW(StateError, "state dict ", path, ": the entry of '", key,
                 "' is malformed: ", e.what());
    }
  }
  // As safetensors' own reader requires: the tensors tile the data, in some order, with
  // no gap or overlap, so together they take exactly the data's bytes.
  std::vector<const SafetensorsEntry*> byOffset;
  for (const auto& e : entries) {
    byOffset.push_back(&e);
  }
  std::stable_sort(byOffset.begin(), byOffset.end(),
                   [](const auto* a, const auto* b) { return a->begin < b->begin; });
  uint64_t covered = 0;
  for (const auto* e : byOffset) {
    HDDP_CHECK_AS(StateError, e->begin == covered, "state dict ", path, ": '", e->key,
                  "' starts at byte ", e->begin, " of the data, where the tensors before it end at ",
                  covered, "; safetensors' tensors tile the data without gaps or overlaps");
    covered = e->end;
  }
  HDDP_CHECK_AS(StateError, covered == dataSize, "state dict ", path, ": its tensors cover ",
                covered, " of the ", dataSize, " bytes of data after the header");
  std::map<std::string, at::Tensor> out;
  for (const auto& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
    if (e.end > e.begin) {
      std::memcpy(t.data_ptr(), bytes.data() + dataStart + e.begin, e.end - e.begin);
    }
    out.emplace(e.key, t);
  }
  return out;
}

std::map<std::string, at::Tensor> fromPickle(const std::string& bytes, const std::string& path) {
  std::map<std::string, at::Tensor> out;
  for (auto& [key, tensor] : train::torchLoadBytes(bytes, path)) {
    out.emplace(key, tensor);
  }
  return out;
}

std::string listed(const std::vector<std::string>& keys) {
  std::ostringstream os;
  for (size_t i = 0; i < keys.size() && i < 8; ++i) {
    os << (i ? ", " : "") << "'" << keys[i] << "'";
  }
  if (keys.size() > 8) {
    os << ", ... (" << keys.size() << " in all)";
  }
  return os.str();
}

// A dtype as Python writes it (torch.float16), what a user of these files knows.
std::string pythonName(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return "float16";
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kBFloat16:
      return "bfloat16";
    case at::kChar:
      return "int8";
    case at::kShort:
      return "int16";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(t);
  }
}

// Integers (bool among them), floating point, complex: a conversion between two of
// these changes the values, not only their precision.
int kindOf(at::ScalarType t) { return at::isComplexType(t) ? 2 : at::isFloatingType(t) ? 1 : 0; }

bool skipped(const std::string& key, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes) {
    if (key.rfind(p, 0) == 0) {
      return true;
    }
  }
  return false;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> stateDictOf(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach().to(at::kCPU));
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach().to(at::kCPU));
  }
  return out;
}

void writeStateDict(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                    const std::string& path) {
  if (isSafetensors(path)) {
    writeFile(path, safetensorsBytes(tensors));
    return;
  }
  writeFile(path, train::torchSaveBytes(tensors));
}

std::map<std::string, at::Tensor> readStateDict(const std::string& path) {
  const std::string bytes = readFile(path);
  return isSafetensors(path) ? fromSafetensors(bytes, path) : fromPickle(bytes, path);
}

void saveStateDict(const torch::nn::Module& module, const std::string& path) {
  writeStateDict(stateDictOf(module), path);
}

LoadStateDictResult loadStateDict(torch::nn::Module& module, const std::string& path,
                                  const LoadStateDictOptions& options) {
  const auto file = readStateDict(path);
  std::vector<std::pair<std::string, at::Tensor>> targets;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    targets.emplace_back(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    targets.emplace_back(item.key(), item.value());
  }
  LoadStateDictResult result;
  std::vector<std::string> misShaped;
  std::set<std::string> known;
  for (const auto& [key, target] : targets) {
    known.insert(key);
    if (skipped(key, options.skipPrefixes)) {
      continue;
    }
    const auto found = file.find(key);
    if (found == file.end()) {
      result.missing.push_back(key);
    } else if (found->second.sizes() != target.sizes()) {
      misShaped.push_back(
          c10::str(key, " (file ", found->second.sizes(), ", model ", target.sizes(), ")"));
    }
  }
  for (const auto& [key, tensor] : file) {
    if (!known.count(key) && !skipped(key, options.skipPrefixes)) {
      result.unexpected.push_back(key);
    }
  }
  HDDP_CHECK_AS(StateError, misShaped.empty(), "state dict ", path,
                " does not fit this model: mis-shaped ", listed(misShaped));
  std::vector<std::string> changesKind;
  for (const auto& [key, target] : targets) {
    const auto found = file.find(key);
    if (skipped(key, options.skipPrefixes) || found == file.end()) {
      continue;
    }
    const at::ScalarType from = found->second.scalar_type();
    const at::ScalarType to = target.scalar_type();
    if (from != to) {
      const std::string what = c10::str(key, " (", pythonName(from), " -> ", pythonName(to), ")");
      result.converted.push_back(what);
      if (kindOf(from) != kindOf(to)) {
        changesKind.push_back(what);
      }
    }
  }
  HDDP_CHECK_AS(StateError, changesKind.empty() || options.allowIntegerFloatConversion,
                "state dict ", path, ": converting ", listed(changesKind),
                " to the model's dtype would cross between integer and floating point "
                "(integers read as weights, or weights truncated to integers), which usually "
                "means another model's or a quantized file. Check the file, or allow it with "
                "LoadStateDictOptions::allowIntegerFloatConversion = true (the trainers' "
                "--init-allow-int-float)");
  HDDP_CHECK_AS(StateError,
                !options.strict || (result.missing.empty() && result.unexpected.empty()),
                "state dict ", path, " does not fit this model:",
                result.missing.empty() ? "" : " missing " + listed(result.missing) + ";",
                result.unexpected.empty() ? "" : " unexpected " + listed(result.unexpected) + ";",
                " load with strict = false, or leave keys out with skipPrefixes (--init-skip)");
  at::NoGradGuard noGrad;
  for (auto& [key, target] : targets) {
    const auto found = file.find(key);
    if (skipped(key, options.skipPrefixes) || found == file.end()) {
      continue;
    }
    target.copy_(found->second.to(target.device(), target.scalar_type()));
    result.loaded.push_back(key);
  }
  if (!result.converted.empty()) {
    HDDP_LOG_WARN("train", "state dict ", path, ": converted ", result.converted.size(),
                  " tensor(s) to the model's dtype: ", listed(result.converted));
  }
  return result;
}

}  // namespace hddp
