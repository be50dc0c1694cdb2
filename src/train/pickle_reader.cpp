// The pickle machine behind torch.save's format (train/pickle_reader.h).
#include "train/pickle_reader.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>

#include "hddp/core/error.h"
#include "train/torch_pickle.h"

namespace hddp {
namespace train {

namespace {

using Value = PickleValue;
using ValuePtr = PickleValuePtr;

void releaseChildren(Value& v, std::vector<ValuePtr>& pending) {
  for (auto& item : v.items) {
    pending.push_back(std::move(item));
  }
  for (auto& [key, value] : v.entries) {
    pending.push_back(std::move(key));
    pending.push_back(std::move(value));
  }
  v.items.clear();
  v.entries.clear();
}

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

// Nothing here recurses over values: each opcode touches the top of the stack, and a
// tensor's arguments are read from fixed positions of their (checked) tuples.
class PickleReader {
 public:
  PickleReader(const std::string& pickle, const std::string& path) : p_(pickle), path_(path) {}

  ValuePtr run() {
    while (true) {
      const char op = byte();
      switch (op) {
        case '\x80':  // PROTO
          byte();
          break;
        case '\x95':  // FRAME
          take(8);
          break;
        case 'c': {  // GLOBAL
          auto g = make(Value::Kind::Global);
          const std::string module = line();
          g->s = module + "." + line();
          push(g);
          break;
        }
        case '\x93': {  // STACK_GLOBAL
          auto name = pop();
          auto module = pop();
          check(name->kind == Value::Kind::String && module->kind == Value::Kind::String,
                "STACK_GLOBAL of something that is not a string");
          auto g = make(Value::Kind::Global);
          g->s = module->s + "." + name->s;
          push(g);
          break;
        }
        case 'q':
          memo_[static_cast<unsigned char>(byte())] = top();
          break;
        case 'r':
          memo_[static_cast<size_t>(u32())] = top();
          break;
        case '\x94':  // MEMOIZE
          memo_[memo_.size()] = top();
          break;
        case 'h':
          push(memoGet(static_cast<unsigned char>(byte())));
          break;
        case 'j':
          push(memoGet(u32()));
          break;
        case ')':
          push(make(Value::Kind::Tuple));
          break;
        case '}':
          push(make(Value::Kind::Dict));
          break;
        case ']':
          push(make(Value::Kind::List));
          break;
        case '(':  // MARK: a new frame, as Python's unpickler keeps a stack of stacks
          marks_.push_back(stack_.size());
          break;
        case 't':
          push(tuple(popToMark()));
          break;
        case '\x85':
        case '\x86':
        case '\x87': {
          std::vector<ValuePtr> items(static_cast<size_t>(op - '\x85' + 1));
          for (size_t k = items.size(); k-- > 0;) {
            items[k] = pop();
          }
          push(tuple(std::move(items)));
          break;
        }
        case 'X':
          pushString(take(u32()));
          break;
        case '\x8c':
          pushString(take(static_cast<unsigned char>(byte())));
          break;
        case '\x8d': {
          uint64_t n = 0;
          std::memcpy(&n, take(8).data(), 8);
          pushString(take(n));
          break;
        }
        case 'J': {
          int32_t v = 0;
          std::memcpy(&v, take(4).data(), 4);
          pushInt(v);
          break;
        }
        case 'K':
          pushInt(static_cast<unsigned char>(byte()));
          break;
        case 'M': {
          const std::string b = take(2);
          pushInt(static_cast<unsigned char>(b[0]) | (static_cast<unsigned char>(b[1]) << 8));
          break;
        }
        case '\x8a': {  // LONG1
          const size_t n = static_cast<unsigned char>(byte());
          const std::string b = take(n);
          check(n <= 8, "an integer of more than 8 bytes");
          int64_t v = 0;
          for (size_t k = 0; k < n; ++k) {
            v |= static_cast<int64_t>(static_cast<unsigned char>(b[k])) << (8 * k);
          }
          if (n > 0 && n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80)) {
            v -= int64_t{1} << (8 * n);  // negative
          }
          pushInt(v);
          break;
        }
        case 'G': {  // BINFLOAT, big-endian
          const std::string b = take(8);
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) {
            bits = (bits << 8) | static_cast<unsigned char>(b[static_cast<size_t>(k)]);
          }
          auto v = make(Value::Kind::Float);
          std::memcpy(&v->f, &bits, 8);
          push(v);
          break;
        }
        case '\x88':
        case '\x89': {
          auto v = make(Value::Kind::Bool);
          v->i = op == '\x88';
          push(v);
          break;
        }
        case 'N':
          push(make(Value::Kind::None));
          break;
        case 'Q':
          push(storage(*pop()));
          break;
        case 'R': {
          auto args = pop();
          auto callable = pop();
          push(reduce(*callable, *args));
          break;
        }
        case 's': {
          auto value = pop();
          auto key = pop();
          auto dict = growing(Value::Kind::Dict);
          adopt(*dict, key);
          adopt(*dict, value);
          dict->entries.emplace_back(std::move(key), std::move(value));
          break;
        }
        case 'u': {
          auto items = popToMark();
          check(items.size() % 2 == 0, "SETITEMS with a key and no value");
          auto dict = growing(Value::Kind::Dict);
          for (size_t k = 0; k < items.size(); k += 2) {
            adopt(*dict, items[k]);
            adopt(*dict, items[k + 1]);
            dict->entries.emplace_back(std::move(items[k]), std::move(items[k + 1]));
          }
          break;
        }
        case 'a': {
          auto value = pop();
          auto list = growing(Value::Kind::List);
          adopt(*list, value);
          list->items.push_back(std::move(value));
          break;
        }
        case 'e': {
          auto items = popToMark();
          auto list = growing(Value::Kind::List);
          for (auto& item : items) {
            adopt(*list, item);
            list->items.push_back(std::move(item));
          }
          break;
        }
        case 'b':  // BUILD: an OrderedDict's attributes (_metadata); nothing to keep
          pop();
          top();
          break;
        case '.':
          return pop();
        default:
          HDDP_THROW(StateError, "state dict ", path_, ": pickle opcode 0x", std::hex,
                     static_cast<int>(static_cast<unsigned char>(op)),
                     " is not one torch.save writes for a dict of tensors");
      }
    }
  }

 private:
  void check(bool ok, const char* what) {
    HDDP_CHECK_AS(StateError, ok, "state dict ", path_, ": its pickle is malformed at byte ",
                  pos_, " of data.pkl: ", what);
  }
  char byte() {
    HDDP_CHECK_AS(StateError, pos_ < p_.size(), "state dict ", path_, ": its pickle ends early");
    return p_[pos_++];
  }
  std::string take(uint64_t n) {
    HDDP_CHECK_AS(StateError, n <= p_.size() - pos_, "state dict ", path_, ": its pickle claims ",
                  n, " bytes at byte ", pos_, " of data.pkl, where ", p_.size() - pos_,
                  " are left");
    std::string out = p_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return out;
  }
  uint32_t u32() {
    uint32_t v = 0;
    std::memcpy(&v, take(4).data(), 4);
    return v;
  }
  std::string line() {
    const size_t end = p_.find('\n', pos_);
    HDDP_CHECK_AS(StateError, end != std::string::npos, "state dict ", path_,
                  ": its pickle ends early");
    std::string out = p_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }
  void push(ValuePtr v) { stack_.push_back(std::move(v)); }
  void pushString(std::string s) {
    auto v = make(Value::Kind::String);
    v->s = std::move(s);
    push(v);
  }
  void pushInt(int64_t i) {
    auto v = make(Value::Kind::Int);
    v->i = i;
    push(v);
  }
  size_t frameBase() const { return marks_.empty() ? 0 : marks_.back(); }
  ValuePtr pop() {
    check(stack_.size() > frameBase(), "it takes a value from an empty stack");
    auto v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  ValuePtr top() {
    check(stack_.size() > frameBase(), "it takes a value from an empty stack");
    return stack_.back();
  }
  std::vector<ValuePtr> popToMark() {
    check(!marks_.empty(), "it closes a MARK it never opened");
    const size_t base = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.begin() + base),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(base);
    return items;
  }
  ValuePtr memoGet(size_t k) {
    const auto found = memo_.find(k);
    HDDP_CHECK_AS(StateError, found != memo_.end(), "state dict ", path_,
                  ": its pickle refers to memo ", k, ", never stored");
    return found->second;
  }
  // `child` goes into `parent`: the one place nesting grows, so the one place it is bounded.
  void adopt(Value& parent, const ValuePtr& child) {
    check(child.get() != &parent, "a list or dict placed inside itself");
    child->contained = true;
    parent.depth = std::max(parent.depth, child->depth + 1);
    HDDP_CHECK_AS(StateError, parent.depth <= kMaxPickleDepth, "state dict ", path_,
                  ": its pickle nests values ", parent.depth, " deep at byte ", pos_,
                  " of data.pkl, beyond hddp's limit of ", kMaxPickleDepth,
                  " (a state dict nests 3 deep). torch.load may read such a file; hddp refuses "
                  "it. Save model.state_dict() alone");
  }
  ValuePtr tuple(std::vector<ValuePtr> items) {
    auto t = make(Value::Kind::Tuple);
    for (const auto& item : items) {
      adopt(*t, item);
    }
    t->items = std::move(items);
    return t;
  }
  // The list or dict on top, to take more items: never one already inside another value.
  ValuePtr growing(Value::Kind kind) {
    ValuePtr v = top();
    check(v->kind == kind, kind == Value::Kind::Dict ? "it sets items of something not a dict"
                                                     : "it appends to something not a list");
    check(!v->contained, "it grows a list or dict already inside another value");
    return v;
  }
  ValuePtr storage(const Value& id) {
    const auto& items = id.items;
    HDDP_CHECK_AS(StateError,
                  id.kind == Value::Kind::Tuple && items.size() == 5 &&
                      items[0]->kind == Value::Kind::String && items[0]->s == "storage" &&
                      items[1]->kind == Value::Kind::Global &&
                      items[2]->kind == Value::Kind::String && items[4]->kind == Value::Kind::Int,
                  "state dict ", path_, ": a persistent id that is not a tensor storage");
    auto v = make(Value::Kind::Storage);
    const std::string& type = items[1]->s;
    bool known = false;
    for (const auto& [name, dtype] : torchStorageTypes()) {
      if (type == "torch." + name) {
        v->dtype = dtype;
        known = true;
      }
    }
    HDDP_CHECK_AS(StateError, known, "state dict ", path_, ": storage type ", type,
                  " is not one hddp reads");
    v->s = items[2]->s;
    v->i = items[4]->i;  // elements
    HDDP_CHECK_AS(StateError, v->i >= 0, "state dict ", path_, ": storage data/", v->s,
                  " claims ", v->i, " elements");
    return v;
  }
  static bool isIntTuple(const Value& v) {
    return v.kind == Value::Kind::Tuple &&
           std::all_of(v.items.begin(), v.items.end(),
                       [](const ValuePtr& item) { return item->kind == Value::Kind::Int; });
  }
  static std::vector<int64_t> ints(const Value& tuple) {
    std::vector<int64_t> out;
    for (const auto& item : tuple.items) {
      out.push_back(item->i);
    }
    return out;
  }
  ValuePtr reduce(const Value& callable, const Value& args) {
    const std::string& name = callable.s;
    check(callable.kind == Value::Kind::Global && args.kind == Value::Kind::Tuple,
          "REDUCE of something that is not a global and its arguments");
    if (name == "collections.OrderedDict" || name == "builtins.dict") {
      return make(Value::Kind::Dict);
    }
    const auto& a = args.items;
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      HDDP_CHECK_AS(StateError,
                    a.size() >= 4 && a[0]->kind == Value::Kind::Storage &&
                        a[1]->kind == Value::Kind::Int && isIntTuple(*a[2]) &&
                        isIntTuple(*a[3]) && a[2]->items.size() == a[3]->items.size(),
                    "state dict ", path_, ": a tensor rebuilt from unexpected arguments");
      auto v = make(Value::Kind::Tensor);
      v->s = a[0]->s;
      v->i = a[0]->i;
      v->dtype = a[0]->dtype;
      v->offset = a[1]->i;
      v->sizes = ints(*a[2]);
      v->strides = ints(*a[3]);
      return v;
    }
    if (name == "torch._utils._rebuild_parameter" && !a.empty() &&
        a[0]->kind == Value::Kind::Tensor) {
      return a[0];
    }
    HDDP_THROW(StateError, "state dict ", path_, " calls ", name,
               ", which a dict of tensors does not need; save model.state_dict()");
  }

  const std::string& p_;
  size_t pos_ = 0;
  const std::string& path_;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;  // where each open MARK's frame starts in stack_
  std::map<size_t, ValuePtr> memo_;
};

}  // namespace

PickleValue::~PickleValue() {
  if (items.empty() && entries.empty()) {
    return;
  }
  std::vector<ValuePtr> pending;
  releaseChildren(*this, pending);
  while (!pending.empty()) {
    ValuePtr v = std::move(pending.back());
    pending.pop_back();
    if (v.use_count() == 1) {
      releaseChildren(*v, pending);  // the last owner: v dies childless, without recursing
    }
  }
}

PickleValuePtr unpickle(const std::string& pickle, const std::string& path) {
  return PickleReader(pickle, path).run();
}

}  // namespace train
}  // namespace hddp
