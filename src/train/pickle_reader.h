// The pickle machine behind torch.save's format (internal to the train layer;
// torch_pickle.cpp reads the tensors from the values it builds). It knows the opcodes
// Python's pickler writes for a dict of tensors (protocol 2, and 4's framing and
// memoizing), and the few callables such a dict needs.
//
// Its input comes from outside, so it is bounded by the bytes present: every length is
// checked against the bytes left, values nest at most kMaxPickleDepth deep, no cycle can
// form, and nothing recurses over the values it builds (their destructor included).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hddp {
namespace train {

/// Deeper than any state dict (its _metadata nests 3 deep) and than Python's pickler
/// writes (it recurses once per level, up to its recursion limit, 1000 by default).
constexpr size_t kMaxPickleDepth = 4096;

struct PickleValue;
using PickleValuePtr = std::shared_ptr<PickleValue>;

/// One value the pickle builds. Containers hold their children by shared_ptr (the memo
/// shares them). `depth` is 1 + the deepest child's; a value placed in a container is
/// `contained`, and a contained list or dict takes no more items, so depths stay exact
/// and no cycle can form (a cycle needs a container to grow after it was placed).
struct PickleValue {
  enum class Kind { None, Bool, Int, Float, String, Tuple, List, Dict, Global, Storage, Tensor };
  Kind kind = Kind::None;
  int64_t i = 0;  // Bool, Int; Storage and Tensor: the storage's elements (>= 0)
  double f = 0;   // Float
  std::string s;  // String; Global: "module.name"; Storage and Tensor: the storage's key
  std::vector<PickleValuePtr> items;                               // Tuple, List
  std::vector<std::pair<PickleValuePtr, PickleValuePtr>> entries;  // Dict
  c10::ScalarType dtype = c10::ScalarType::Float;                  // Storage, Tensor
  // Tensor: a view of its storage, unchecked (torch_pickle.cpp checks it against the
  // storage, once the key it is stored under is known, before allocating anything).
  int64_t offset = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  size_t depth = 1;
  bool contained = false;

  PickleValue() = default;
  PickleValue(const PickleValue&) = delete;
  PickleValue& operator=(const PickleValue&) = delete;
  /// Tears the children down from an explicit stack: the default destructor recurses once
  /// per level, and a chain of 300,000 nested tuples (a 300 KB pickle) overflows the stack.
  ~PickleValue();
};

/// Runs `pickle` (the data.pkl of state dict `path`) to its STOP and returns the value
/// then on top. hddp::StateError naming `path`, and where data.pkl goes wrong, when it is
/// malformed, nests deeper than kMaxPickleDepth, or calls anything a dict of tensors
/// does not need.
PickleValuePtr unpickle(const std::string& pickle, const std::string& path);

}  // namespace train
}  // namespace hddp
