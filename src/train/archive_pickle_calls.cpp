// What LibTorch's unpickler makes of each callable of an archive's pickle, and of its
// storages (train/archive_pickle_machine.h): each storage checked against its record,
// each tensor against its storage, a type's name against the parser's nesting.
#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "train/archive_pickle_machine.h"
#include "train/torch_pickle.h"

namespace hddp {
namespace train {
namespace archive_pickle {

namespace {

// The longest name of a global or of a type hddp reads (hddp's are under 100 bytes): each
// REDUCE or BUILD compares its callable's name, which a pickle may name again and again.
constexpr size_t kMaxGlobalName = 4096;

// The storage types LibTorch's unpickler resolves (torch.<Name>Storage): every ScalarType
// of the LibTorch hddp is built against (Float8_e8m0fnu, Float4_e2m1fn_x2, Bits*, UInt1-7,
// Int1-7...), quantized ones aside.
std::optional<c10::ScalarType> storageType(const std::string& name) {
  using c10::ScalarType;
  static const std::unordered_map<std::string, ScalarType> types = [] {
    std::unordered_map<std::string, ScalarType> out;
    // Every type of LibTorch's ScalarType.h; the quantized ones are skipped below.
#define HDDP_STORAGE_TYPE(_, name) ScalarType::name,
    const ScalarType all[] = {AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(HDDP_STORAGE_TYPE)};
#undef HDDP_STORAGE_TYPE
    for (const ScalarType t : all) {
      if (c10::isQIntType(t)) {
        continue;
      }
      out.emplace(std::string(c10::toString(t)) + "Storage", t);
    }
    return out;
  }();
  const auto found = types.find(name);
  return found == types.end() ? std::nullopt : std::optional<ScalarType>(found->second);
}

// Deepest nesting of brackets in a type's name.
size_t bracketNesting(const std::string& text) {
  size_t depth = 0;
  size_t deepest = 0;
  for (const char c : text) {
    if (c == '[' || c == '(') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == ')') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

// A GLOBAL: what LibTorch's unpickler resolves it to.
uint32_t ArchivePickleMachine::global(const std::string& module, const std::string& name,
                                      size_t at) {
  check(module.size() + name.size() <= kMaxGlobalName, at, "a GLOBAL's name of ",
        module.size() + name.size(), " bytes, beyond hddp's limit of ", kMaxGlobalName);
  if (module == "torch") {
    if (const auto type = storageType(name)) {
      const uint32_t v = make(Kind::StorageType);
      values_[v].dtype = *type;
      return v;
    }
  }
  const std::string full = module + "." + name;
  static const char* const kCallables[] = {"torch._utils._rebuild_tensor_v2",
                                           "collections.OrderedDict",
                                           "builtins.complex",
                                           "torch.device",
                                           "torch.jit._pickle.build_intlist",
                                           "torch.jit._pickle.build_tensorlist",
                                           "torch.jit._pickle.build_doublelist",
                                           "torch.jit._pickle.build_boollist",
                                           "torch.jit._pickle.restore_type_tag"};
  const bool known =
      std::find(std::begin(kCallables), std::end(kCallables), full) != std::end(kCallables);
  // The archive's own classes (`__torch__.` and the path of their code/ file).
  const bool archiveClass = module == "__torch__" || module.rfind("__torch__.", 0) == 0;
  check(known || archiveClass, at, "it calls ", full,
        ", which no archive of hddp's holds (a quantized, sparse or subclassed tensor, or "
        "an unknown global)");
  const uint32_t v = make(Kind::Global);
  values_[v].s = full;
  return v;
}

const Value& ArchivePickleMachine::argumentTuple(uint32_t argument, size_t size,
                                                 const std::string& callable, size_t at) {
  const Value& a = values_[argument];
  check(a.kind == Kind::Tuple && a.items.size() == size, at, callable, " called with ",
        a.kind == Kind::Tuple ? std::to_string(a.items.size()) + " arguments"
                              : std::string("something not a tuple"),
        " where it takes ", size);
  return a;
}

Kind ArchivePickleMachine::kindOf(const Value& tuple, size_t k) const {
  return values_[tuple.items[k]].kind;
}

// REDUCE or BUILD: LibTorch calls the global below the argument; what it makes of it.
uint32_t ArchivePickleMachine::call(uint32_t callable, uint32_t argument, size_t at) {
  check(values_[callable].kind == Kind::Global, at,
        "REDUCE or BUILD of something that is not a global");
  const std::string& name = values_[callable].s;  // values_ may grow below: used before
  if (name == "torch._utils._rebuild_tensor_v2") {
    return tensorView(argument, at);
  }
  if (name == "collections.OrderedDict") {  // a tensor's backward hooks: dropped
    return make(Kind::None);
  }
  if (name == "builtins.complex") {
    const Value& a = argumentTuple(argument, 2, name, at);
    check(kindOf(a, 0) == Kind::Float && kindOf(a, 1) == Kind::Float, at,
          "a complex number of something else than two floats");
    return make(Kind::Other);
  }
  if (name == "torch.device") {
    const Value& a = argumentTuple(argument, 1, name, at);
    check(kindOf(a, 0) == Kind::String, at, "a device named by something not a string");
    return make(Kind::Other);
  }
  if (name == "torch.jit._pickle.restore_type_tag") {
    const Value& a = argumentTuple(argument, 2, name, at);
    check(kindOf(a, 1) == Kind::String, at, "a type named by something not a string");
    const std::string& type = values_[a.items[1]].s;
    // Bounded, so that a type named again and again costs little each time.
    check(type.size() <= kMaxGlobalName, at, "a type's name of ", type.size(),
          " bytes, beyond hddp's limit of ", kMaxGlobalName);
    const size_t nesting = bracketNesting(type);
    check(nesting <= kMaxArchiveCodeNesting, at, "type ", type.substr(0, 64), "... nests brackets ",
          nesting, " deep, beyond hddp's limit of ", kMaxArchiveCodeNesting);
    return a.items[0];
  }
  if (name.rfind("torch.jit._pickle.build_", 0) == 0) {  // a typed list: the list itself
    const Value& a = argumentTuple(argument, 1, name, at);
    check(kindOf(a, 0) == Kind::List, at, name, " of something not a list");
    return a.items[0];
  }
  // An instance of the archive's class `name`, from the dict of its attributes (LibTorch
  // sets each slot from it; no class here has a __setstate__, see checkTorchArchive).
  check(values_[argument].kind == Kind::Dict, at, "an instance of ", name,
        " built from something that is not a dict of its attributes");
  const uint32_t object = make(Kind::Object);
  adopt(object, argument, at);
  return object;
}

// BINPERSID: ("storage", torch.<Type>Storage, key, device, elements), which LibTorch reads
// as a storage of elements x the type's size from record <tensorDir><key>.
uint32_t ArchivePickleMachine::storage(uint32_t id, size_t at) {
  const Value& t = values_[id];
  check(t.kind == Kind::Tuple && t.items.size() == 5 && kindOf(t, 0) == Kind::String &&
            values_[t.items[0]].s == "storage" && kindOf(t, 1) == Kind::StorageType &&
            kindOf(t, 2) == Kind::String && kindOf(t, 3) == Kind::String &&
            kindOf(t, 4) == Kind::Int,
        at, "a persistent id that is not (\"storage\", a storage type, key, device, elements)");
  const c10::ScalarType dtype = values_[t.items[1]].dtype;
  const std::string& key = values_[t.items[2]].s;
  const int64_t elements = values_[t.items[4]].i;
  check(elements >= 0, at, "storage ", key, " claims ", elements, " elements");
  if (elements > 0) {  // LibTorch reads no record for an empty storage
    check(!tensorDir_.empty(), at, "a tensor in a pickle that holds none");
    const std::string record = tensorDir_ + key;
    const std::optional<uint64_t> present = recordSize_(record);
    check(present.has_value(), at, "storage ", key, " has its data in ", record,
          ", which the archive lacks");
    const auto claimed = tensorBytes({elements}, c10::elementSize(dtype));
    check(claimed && *claimed <= *present, at, "storage ", key, " claims ", elements,
          " elements of ", dtype, " (", bytesText(claimed), ") in ", record, ", which holds ",
          *present, " bytes");
    // LibTorch reads the record again for each BINPERSID that names it.
    check(*present <= budget_, at, "its storages read more bytes than the archive holds (", record,
          " again, or another copy)");
    budget_ -= *present;
  }
  const uint32_t v = make(Kind::Tensor);
  values_[v].dtype = dtype;
  values_[v].i = elements;
  return v;
}

// _rebuild_tensor_v2(storage, offset, sizes, strides, requires_grad, hooks[, metadata]):
// LibTorch sets the sizes and strides on the storage as they are.
uint32_t ArchivePickleMachine::tensorView(uint32_t argument, size_t at) {
  const Value& a = values_[argument];
  const size_t n = a.kind == Kind::Tuple ? a.items.size() : 0;
  check((n == 6 || n == 7) && kindOf(a, 0) == Kind::Tensor && kindOf(a, 1) == Kind::Int &&
            kindOf(a, 2) == Kind::Tuple && kindOf(a, 3) == Kind::Tuple &&
            kindOf(a, 4) == Kind::Bool && (n == 6 || kindOf(a, 6) == Kind::Dict),
        at, "a tensor rebuilt from unexpected arguments");
  const c10::ScalarType dtype = values_[a.items[0]].dtype;
  const auto held = static_cast<uint64_t>(values_[a.items[0]].i);
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  for (const auto& [from, into] :
       {std::make_pair(a.items[2], &sizes), std::make_pair(a.items[3], &strides)}) {
    for (const uint32_t item : values_[from].items) {
      check(values_[item].kind == Kind::Int, at, "a tensor's size or stride is not an integer");
      into->push_back(values_[item].i);
    }
  }
  const int64_t offset = values_[a.items[1]].i;
  check(viewFitsStorage(sizes, strides, offset, held), at, "a tensor of size ",
        c10::IntArrayRef(sizes), ", stride ", c10::IntArrayRef(strides), " and offset ", offset,
        " on a storage of ", held, " elements; a tensor must lie within its storage");
  const uint32_t v = make(Kind::Tensor);
  values_[v].dtype = dtype;
  values_[v].i = static_cast<int64_t>(held);
  return v;
}

}  // namespace archive_pickle
}  // namespace train
}  // namespace hddp
