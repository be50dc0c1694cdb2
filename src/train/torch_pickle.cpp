// torch.save's file format for a dict of tensors, the reading half (internal to the train
// layer; torch_pickle_writer.cpp writes it): a zip archive (caffe2::serialize, the
// container LibTorch and Python share) holding data.pkl, a pickle (protocol 2) of
// collections.OrderedDict name ->
// torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks),
// with each storage a persistent id ("storage", torch.<Type>Storage, key, "cpu", numel)
// whose bytes are the record data/<key>.
//
// LibTorch's own torch::pickle_save/pickle_load cannot stand in: its unpickler turns an
// OrderedDict (what model.state_dict() is) into None, and its pickler tags typed dicts
// with torch.jit._pickle.restore_type_tag, which torch.load(weights_only=True) refuses.
//
// The file comes from outside, so nothing it claims is trusted before it is checked
// against the bytes present (DESIGN.md, "Readers of outside bytes are bounded"): the zip
// entries (torch_zip_check.cpp), the pickle (pickle_reader.h: lengths, nesting depth,
// no recursion), each storage against its record and each tensor against its storage.
// A tensor is a view of its storage, as torch.load returns it, so the tensors together
// take no more memory than the file's records.
#include "train/torch_pickle.h"

#include <c10/util/safe_numerics.h>
#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "train/pickle_reader.h"

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

std::optional<uint64_t> tensorBytes(c10::ArrayRef<int64_t> sizes, size_t elementSize) {
  bool empty = false;
  for (int64_t s : sizes) {
    if (s < 0) {
      return std::nullopt;
    }
    empty = empty || s == 0;
  }
  if (empty) {
    return 0;  // however large the other sizes
  }
  uint64_t bytes = elementSize;
  for (int64_t s : sizes) {
    if (c10::mul_overflows(bytes, static_cast<uint64_t>(s), &bytes)) {
      return std::nullopt;
    }
  }
  return bytes;
}

std::string bytesText(std::optional<uint64_t> bytes) {
  return bytes ? std::to_string(*bytes) + " bytes" : "more than 2^64 bytes (or a negative size)";
}

bool viewFitsStorage(c10::ArrayRef<int64_t> sizes, c10::ArrayRef<int64_t> strides, int64_t offset,
                     uint64_t held) {
  if (offset < 0 || sizes.size() != strides.size()) {
    return false;
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0 || strides[d] < 0) {
      return false;
    }
  }
  // The view's extent, offset + sum((size - 1) * stride) + 1 (0 when a size is 0), within
  // held. Strides of 0 (an expanded tensor, which LibTorch saves as such) are allowed: the
  // view takes no memory beyond its storage.
  for (int64_t s : sizes) {
    if (s == 0) {
      return true;
    }
  }
  uint64_t last = static_cast<uint64_t>(offset);
  bool fits = true;
  for (size_t d = 0; d < sizes.size(); ++d) {
    uint64_t step = 0;
    fits = fits &&
           !c10::mul_overflows(static_cast<uint64_t>(sizes[d] - 1),
                               static_cast<uint64_t>(strides[d]), &step) &&
           !c10::add_overflows(last, step, &last);
  }
  fits = fits && last < held;
  return fits;
}

namespace {

using Value = PickleValue;

// The tensors of a pickle's values, read from the archive's records.
class TensorReader {
 public:
  TensorReader(caffe2::serialize::PyTorchStreamReader& archive, const std::string& path)
      : archive_(archive), path_(path) {}

  /// The tensor `value` (a Tensor) describes: a view of its storage, after checking the
  /// storage against its record and the view against the storage, before allocating.
  at::Tensor tensor(const std::string& key, const Value& value) {
    const at::Tensor storage = storageTensor(key, value);
    const c10::IntArrayRef sizes(value.sizes);
    const c10::IntArrayRef strides(value.strides);
    bool valid = value.offset >= 0;
    for (size_t d = 0; d < sizes.size(); ++d) {
      valid = valid && sizes[d] >= 0 && strides[d] >= 0;
    }
    HDDP_CHECK_AS(StateError, valid, "state dict ", path_, ": '", key, "' has size ", sizes,
                  ", stride ", strides, " and storage offset ", value.offset,
                  "; negative ones are no tensor torch.save writes");
    // Within the storage, and (for a torch.save file) no more elements than it holds: an
    // expanded view, stride 0, is refused here, as the caller's copy would allocate the
    // claimed size.
    const auto held = static_cast<uint64_t>(value.i);
    const auto elements = tensorBytes(sizes, 1);
    const bool fits =
        viewFitsStorage(sizes, strides, value.offset, held) && elements && *elements <= held;
    const size_t elementSize = c10::elementSize(value.dtype);
    HDDP_CHECK_AS(StateError, fits, "state dict ", path_, ": '", key, "' claims ",
                  bytesText(tensorBytes(sizes, elementSize)), " (size ", sizes, ", stride ",
                  strides, ", storage offset ", value.offset, ", ", value.dtype,
                  ") of its storage data/", value.s, ", which holds ", held * elementSize,
                  " bytes; a tensor must lie within its storage and be no larger than it");
    return storage.as_strided(sizes, strides, value.offset);
  }

 private:
  // Storage `value.s`, read once however many tensors view it; its claimed size is
  // checked against its record before anything is allocated.
  at::Tensor storageTensor(const std::string& key, const Value& value) {
    const std::string record = "data/" + value.s;
    const auto found = storages_.find(value.s);
    if (found != storages_.end()) {
      HDDP_CHECK_AS(StateError,
                    found->second.scalar_type() == value.dtype && found->second.numel() == value.i,
                    "state dict ", path_, ": '", key, "' reads ", record, " as ", value.i,
                    " elements of ", value.dtype, ", another tensor as ", found->second.numel(),
                    " of ", found->second.scalar_type());
      return found->second;
    }
    HDDP_CHECK_AS(StateError, archive_.hasRecord(record), "state dict ", path_, ": '", key,
                  "' has its data in ", record, ", which the file lacks");
    const size_t present = archive_.getRecordSize(record);
    const auto claimed = tensorBytes({value.i}, c10::elementSize(value.dtype));
    HDDP_CHECK_AS(StateError, claimed && *claimed == present, "state dict ", path_, ": '", key,
                  "' claims ", value.i, " elements of ", value.dtype, " (", bytesText(claimed),
                  ") in ", record, ", which holds ", present, " bytes");
    at::Tensor t = at::empty({value.i}, at::TensorOptions().dtype(value.dtype));
    if (present > 0) {
      archive_.getRecord(record, t.data_ptr(), present);
    }
    storages_.emplace(value.s, t);
    return t;
  }

  caffe2::serialize::PyTorchStreamReader& archive_;
  const std::string& path_;
  std::map<std::string, at::Tensor> storages_;
};

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> torchLoadBytes(const std::string& bytes,
                                                               const std::string& path) {
  checkZipEntrySizes(bytes, "state dict " + path);  // before LibTorch's reader allocates any entry
  std::istringstream in(bytes);
  try {
    caffe2::serialize::PyTorchStreamReader archive(&in);
    HDDP_CHECK_AS(StateError, archive.hasRecord("data.pkl"), "state dict ", path,
                  " has no data.pkl: not a torch.save file");
    auto [data, size] = archive.getRecord("data.pkl");
    const std::string pickle(static_cast<const char*>(data.get()), size);
    const PickleValuePtr root = unpickle(pickle, path);
    TensorReader reader(archive, path);
    HDDP_CHECK_AS(StateError, root->kind == Value::Kind::Dict, "state dict ", path,
                  " holds no dict (save model.state_dict())");
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& [key, value] : root->entries) {
      HDDP_CHECK_AS(StateError,
                    key->kind == Value::Kind::String && value->kind == Value::Kind::Tensor,
                    "state dict ", path, ": an entry that is not name -> tensor");
      out.emplace_back(key->s, reader.tensor(key->s, *value));
    }
    return out;
  } catch (const StateError&) {
    throw;
  } catch (const c10::Error& e) {  // the zip reader's own complaints
    rethrowIfOutOfMemory();        // but host memory is no fault of the file's
    HDDP_THROW(StateError, "state dict ", path,
               " is not a readable torch.save file: ", e.what_without_backtrace());
  }
}

}  // namespace train
}  // namespace hddp
