// The machine behind checkArchivePickle (train/archive_check.h), internal to the train
// layer: its opcodes in archive_pickle_check.cpp, what LibTorch makes of each callable
// (tensors, storages, typed lists, the archive's classes) in archive_pickle_calls.cpp.
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hddp/core/error.h"
#include "train/archive_check.h"

namespace hddp {
namespace train {
namespace archive_pickle {

enum class Kind : uint8_t {
  None,
  Bool,
  Int,
  Float,
  String,
  Tuple,
  List,
  Dict,
  Global,       // a callable of GLOBAL, by name ("module.name")
  StorageType,  // torch.FloatStorage and the like: a dtype
  Tensor,       // a storage's tensor (BINPERSID) or a view of it (_rebuild_tensor_v2)
  Object,       // an instance of one of the archive's classes
  Other,        // complex, device: nothing in them is a size
};

// What the machine keeps of a value. Values live in one vector and refer to each other
// by index, so nothing is freed recursively; a value placed in a container is
// `contained`, and a contained list or dict takes no more items, so depths stay exact and
// no cycle can form.
struct Value {
  Kind kind = Kind::None;
  bool contained = false;
  c10::ScalarType dtype = c10::ScalarType::Byte;  // StorageType, Tensor
  uint32_t depth = 1;
  int64_t i = 0;                // Bool, Int; Tensor: its storage's elements
  std::string s;                // String; Global: "module.name"
  std::vector<uint32_t> items;  // Tuple
};

class ArchivePickleMachine {
 public:
  ArchivePickleMachine(const std::string& pickle, const std::string& name,
                       const std::string& tensorDir,
                       const std::function<std::optional<uint64_t>(const std::string&)>& recordSize,
                       uint64_t& storageBudget, const std::string& what)
      : p_(pickle),
        name_(name),
        tensorDir_(tensorDir),
        recordSize_(recordSize),
        budget_(storageBudget),
        what_(what) {}

  /// Runs the pickle to its STOP; hddp::StateError at the first thing LibTorch's
  /// unpickler would do wrong, or without bound, with it.
  void run();

 private:
  template <typename... Args>
  [[noreturn]] void fail(size_t at, const Args&... detail) {
    HDDP_THROW(StateError, what_, ": its pickle ", name_, " is malformed at byte ", at, ": ",
               detail...,
               ". Resume from an earlier state file; this one is damaged or was not "
               "written by hddp");
  }
  template <typename... Args>
  void check(bool ok, size_t at, const Args&... detail) {
    if (!ok) {
      fail(at, detail...);
    }
  }

  uint8_t byte() {
    check(pos_ < p_.size(), pos_, "it ends before its STOP");
    return static_cast<uint8_t>(p_[pos_++]);
  }
  const char* take(uint64_t n, size_t at) {
    check(n <= p_.size() - pos_, at, "it claims ", n, " bytes where ", p_.size() - pos_,
          " are left (LibTorch's unpickler would allocate them before reading)");
    const char* out = p_.data() + pos_;
    pos_ += static_cast<size_t>(n);
    return out;
  }
  uint32_t u32() {
    uint32_t v = 0;
    std::memcpy(&v, take(4, pos_), 4);
    return v;
  }
  std::string line(size_t at) {
    const size_t end = p_.find('\n', pos_);
    check(end != std::string::npos, at, "a GLOBAL's name does not end before the pickle does");
    std::string out = p_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }

  uint32_t make(Kind kind) {
    values_.emplace_back();
    values_.back().kind = kind;
    return static_cast<uint32_t>(values_.size() - 1);
  }
  uint32_t number(Kind kind, int64_t i) {
    const uint32_t v = make(kind);
    values_[v].i = i;
    return v;
  }
  void push(uint32_t v) { stack_.push_back(v); }
  size_t frameBase() const { return marks_.empty() ? 0 : marks_.back(); }
  uint32_t pop(size_t at) {
    check(stack_.size() > frameBase(), at,
          "it takes a value from an empty stack or from below "
          "its MARK");
    const uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::vector<uint32_t> popToMark(size_t at) {
    check(!marks_.empty(), at, "it closes a MARK it never opened");
    const size_t base = marks_.back();
    marks_.pop_back();
    std::vector<uint32_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(base), stack_.end());
    stack_.resize(base);
    return items;
  }

  void memoize(uint32_t index, size_t at) {
    // LibTorch's unpickler makes room for every index up to this one (16 bytes each).
    check(index < p_.size(), at, "it stores memo ", index, ", beyond the pickle's own size of ",
          p_.size(), " bytes (LibTorch's unpickler would make room for ", uint64_t{index} + 1,
          " values)");
    check(!stack_.empty(), at, "it memoizes a value of an empty stack");
    memo_[index] = stack_.back();
  }
  uint32_t recall(uint32_t index, size_t at) {
    const auto found = memo_.find(index);
    check(found != memo_.end(), at, "it refers to memo ", index, ", never stored");
    return found->second;
  }

  // `child` goes into `parent`: the one place nesting grows, so the one place it is bounded.
  void adopt(uint32_t parent, uint32_t child, size_t at) {
    check(parent != child, at, "a list or dict placed inside itself");
    values_[child].contained = true;
    Value& p = values_[parent];
    p.depth = std::max(p.depth, values_[child].depth + 1);
    check(p.depth <= kMaxArchiveDepth, at, "values nest ", p.depth,
          " deep, beyond hddp's limit of ", kMaxArchiveDepth,
          " (LibTorch frees them recursively; hddp's archives nest about 10 "
          "deep)");
  }
  uint32_t tuple(std::vector<uint32_t> items, size_t at) {
    const uint32_t t = make(Kind::Tuple);
    for (const uint32_t item : items) {
      adopt(t, item, at);
    }
    values_[t].items = std::move(items);
    return t;
  }
  // `items` into the list or dict on top (never one already inside another value).
  void grow(Kind kind, const std::vector<uint32_t>& items, size_t at) {
    check(stack_.size() > frameBase(), at, "it adds items to nothing");
    const uint32_t container = stack_.back();
    const bool dict = kind == Kind::Dict;
    check(values_[container].kind == kind, at,
          dict ? "it sets items of something not a dict" : "it appends to something not a list");
    check(!dict || items.size() % 2 == 0, at, "it sets a key without a value");
    check(!values_[container].contained, at,
          "it grows a list or dict already inside another value");
    for (const uint32_t item : items) {
      adopt(container, item, at);
    }
  }

  // A GLOBAL: what LibTorch's unpickler resolves it to.
  uint32_t global(const std::string& module, const std::string& name, size_t at);
  const Value& argumentTuple(uint32_t argument, size_t size, const std::string& callable,
                             size_t at);
  Kind kindOf(const Value& tuple, size_t k) const;
  // REDUCE or BUILD: LibTorch calls the global below the argument; what it makes of it.
  uint32_t call(uint32_t callable, uint32_t argument, size_t at);
  // BINPERSID: ("storage", torch.<Type>Storage, key, device, elements), which LibTorch reads
  // as a storage of elements x the type's size from record <tensorDir><key>.
  uint32_t storage(uint32_t id, size_t at);
  // _rebuild_tensor_v2(storage, offset, sizes, strides, requires_grad, hooks[, metadata]):
  // LibTorch sets the sizes and strides on the storage as they are.
  uint32_t tensorView(uint32_t argument, size_t at);

  const std::string& p_;
  size_t pos_ = 0;
  const std::string& name_;
  const std::string& tensorDir_;
  const std::function<std::optional<uint64_t>(const std::string&)>& recordSize_;
  uint64_t& budget_;
  const std::string& what_;
  std::vector<Value> values_;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;  // where each open MARK's frame starts in stack_
  std::unordered_map<uint32_t, uint32_t> memo_;
};

}  // namespace archive_pickle
}  // namespace train
}  // namespace hddp
