// torch.save's file format for a dict of tensors (internal to the train layer): a zip
// archive (caffe2::serialize, the container LibTorch and Python share) holding
// data.pkl, a pickle (protocol 2) of collections.OrderedDict name ->
// torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks),
// with each storage a persistent id ("storage", torch.<Type>Storage, key, "cpu", numel)
// whose bytes are the record data/<key>.
//
// LibTorch's own torch::pickle_save/pickle_load cannot stand in: its unpickler turns an
// OrderedDict (what model.state_dict() is) into None, and its pickler tags typed dicts
// with torch.jit._pickle.restore_type_tag, which torch.load(weights_only=True) refuses.
#include "train/torch_pickle.h"

#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <memory>
#include <sstream>

#include "hddp/core/error.h"

namespace hddp {
namespace train {

const std::vector<std::pair<std::string, at::ScalarType>>& torchStorageTypes() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"FloatStorage", at::kFloat}, {"DoubleStorage", at::kDouble},
      {"HalfStorage", at::kHalf},   {"BFloat16Storage", at::kBFloat16},
      {"LongStorage", at::kLong},   {"IntStorage", at::kInt},
      {"ShortStorage", at::kShort}, {"CharStorage", at::kChar},
      {"ByteStorage", at::kByte},   {"BoolStorage", at::kBool}};
  return names;
}

namespace {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind {
    None,
    Bool,
    Int,
    Float,
    String,
    Tuple,
    List,
    Dict,
    Global,
    Storage,
    Tensor,
    Mark
  };
  Kind kind = Kind::None;
  int64_t i = 0;
  double f = 0;
  std::string s;                // String; Global: "module.name"; Storage: key
  std::vector<ValuePtr> items;  // Tuple, List
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;  // Dict
  at::ScalarType dtype = at::kFloat;                   // Storage
  at::Tensor tensor;                                   // Tensor
};

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

class PickleReader {
 public:
  PickleReader(const std::string& pickle, caffe2::serialize::PyTorchStreamReader& archive,
               const std::string& path)
      : p_(pickle), archive_(archive), path_(path) {}

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
        case '(':
          push(make(Value::Kind::Mark));
          break;
        case 't': {
          auto t = make(Value::Kind::Tuple);
          t->items = popToMark();
          push(t);
          break;
        }
        case '\x85':
        case '\x86':
        case '\x87': {
          const int n = op - '\x85' + 1;
          auto t = make(Value::Kind::Tuple);
          t->items.resize(static_cast<size_t>(n));
          for (int k = n - 1; k >= 0; --k) {
            t->items[static_cast<size_t>(k)] = pop();
          }
          push(t);
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
          pushString(take(static_cast<size_t>(n)));
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
          HDDP_CHECK_AS(StateError, n <= 8, "state dict ", path_, ": an integer of ", n, " bytes");
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
          push(storage(pop()));
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
          dictOf(top())->entries.emplace_back(key, value);
          break;
        }
        case 'u': {
          auto items = popToMark();
          auto dict = dictOf(top());
          for (size_t k = 0; k + 1 < items.size(); k += 2) {
            dict->entries.emplace_back(items[k], items[k + 1]);
          }
          break;
        }
        case 'a': {
          auto value = pop();
          top()->items.push_back(value);
          break;
        }
        case 'e': {
          auto items = popToMark();
          auto list = top();
          list->items.insert(list->items.end(), items.begin(), items.end());
          break;
        }
        case 'b':  // BUILD: an OrderedDict's attributes (_metadata); nothing to keep
          pop();
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
  char byte() {
    HDDP_CHECK_AS(StateError, pos_ < p_.size(), "state dict ", path_, ": its pickle ends early");
    return p_[pos_++];
  }
  std::string take(size_t n) {
    HDDP_CHECK_AS(StateError, n <= p_.size() - pos_, "state dict ", path_,
                  ": its pickle ends early");
    std::string out = p_.substr(pos_, n);
    pos_ += n;
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
  ValuePtr pop() {
    HDDP_CHECK_AS(StateError, !stack_.empty(), "state dict ", path_, ": its pickle is malformed");
    auto v = stack_.back();
    stack_.pop_back();
    return v;
  }
  ValuePtr top() {
    HDDP_CHECK_AS(StateError, !stack_.empty(), "state dict ", path_, ": its pickle is malformed");
    return stack_.back();
  }
  std::vector<ValuePtr> popToMark() {
    std::vector<ValuePtr> items;
    while (true) {
      auto v = pop();
      if (v->kind == Value::Kind::Mark) {
        break;
      }
      items.push_back(v);
    }
    return std::vector<ValuePtr>(items.rbegin(), items.rend());
  }
  ValuePtr memoGet(size_t k) {
    const auto found = memo_.find(k);
    HDDP_CHECK_AS(StateError, found != memo_.end(), "state dict ", path_,
                  ": its pickle refers to memo ", k, ", never stored");
    return found->second;
  }
  ValuePtr dictOf(const ValuePtr& v) {
    HDDP_CHECK_AS(StateError, v->kind == Value::Kind::Dict, "state dict ", path_,
                  ": its pickle sets items of something that is not a dict");
    return v;
  }
  ValuePtr storage(const ValuePtr& id) {
    HDDP_CHECK_AS(StateError,
                  id->kind == Value::Kind::Tuple && id->items.size() == 5 &&
                      id->items[0]->s == "storage" && id->items[1]->kind == Value::Kind::Global,
                  "state dict ", path_, ": a persistent id that is not a tensor storage");
    auto v = make(Value::Kind::Storage);
    const std::string& type = id->items[1]->s;
    bool known = false;
    for (const auto& [name, dtype] : torchStorageTypes()) {
      if (type == "torch." + name) {
        v->dtype = dtype;
        known = true;
      }
    }
    HDDP_CHECK_AS(StateError, known, "state dict ", path_, ": storage type ", type,
                  " is not one hddp reads");
    v->s = id->items[2]->s;
    v->i = id->items[4]->i;  // elements
    return v;
  }
  at::Tensor storageTensor(const Value& storage) {
    const auto found = storages_.find(storage.s);
    if (found != storages_.end()) {
      return found->second;
    }
    at::Tensor t = at::empty({storage.i}, at::TensorOptions().dtype(storage.dtype));
    const std::string record = "data/" + storage.s;
    HDDP_CHECK_AS(StateError, archive_.hasRecord(record), "state dict ", path_, " lacks ", record);
    auto [data, size] = archive_.getRecord(record);
    HDDP_CHECK_AS(StateError, size == static_cast<size_t>(t.nbytes()), "state dict ", path_, ": ",
                  record, " holds ", size, " bytes for ", storage.i, " elements of ",
                  storage.dtype);
    std::memcpy(t.data_ptr(), data.get(), size);
    storages_.emplace(storage.s, t);
    return t;
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
    if (name == "collections.OrderedDict" || name == "builtins.dict") {
      return make(Value::Kind::Dict);
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      HDDP_CHECK_AS(StateError,
                    args.items.size() >= 4 && args.items[0]->kind == Value::Kind::Storage,
                    "state dict ", path_, ": a tensor rebuilt from unexpected arguments");
      const at::Tensor storage = storageTensor(*args.items[0]);
      auto v = make(Value::Kind::Tensor);
      v->tensor =
          storage.as_strided(ints(*args.items[2]), ints(*args.items[3]), args.items[1]->i).clone();
      return v;
    }
    if (name == "torch._utils._rebuild_parameter" && !args.items.empty()) {
      return args.items[0];
    }
    HDDP_THROW(StateError, "state dict ", path_, " calls ", name,
               ", which a dict of tensors does not need; save model.state_dict()");
  }

  const std::string& p_;
  size_t pos_ = 0;
  caffe2::serialize::PyTorchStreamReader& archive_;
  const std::string& path_;
  std::vector<ValuePtr> stack_;
  std::map<size_t, ValuePtr> memo_;
  std::map<std::string, at::Tensor> storages_;
};

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> torchLoadBytes(const std::string& bytes,
                                                               const std::string& path) {
  std::istringstream in(bytes);
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(&in);
  } catch (const c10::Error& e) {
    HDDP_THROW(StateError, "state dict ", path,
               " is not a torch.save file: ", e.what_without_backtrace());
  }
  HDDP_CHECK_AS(StateError, archive->hasRecord("data.pkl"), "state dict ", path,
                " has no data.pkl: not a torch.save file");
  auto [data, size] = archive->getRecord("data.pkl");
  const std::string pickle(static_cast<const char*>(data.get()), size);
  PickleReader reader(pickle, *archive, path);
  const ValuePtr root = reader.run();
  HDDP_CHECK_AS(StateError, root->kind == Value::Kind::Dict, "state dict ", path,
                " holds no dict (save model.state_dict())");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [key, value] : root->entries) {
    HDDP_CHECK_AS(StateError,
                  key->kind == Value::Kind::String && value->kind == Value::Kind::Tensor,
                  "state dict ", path, ": an entry that is not name -> tensor");
    out.emplace_back(key->s, value->tensor);
  }
  return out;
}

}  // namespace train
}  // namespace hddp
