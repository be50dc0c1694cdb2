// torch.save's file format for a dict of tensors, written and read without Python
// (internal to the train layer; hddp/train/state_dict.h uses it for .pt files).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hddp {
namespace train {

/// torch.save's storage type names (FloatStorage, ...) and the dtypes hddp reads and
/// writes them as.
const std::vector<std::pair<std::string, at::ScalarType>>& torchStorageTypes();

/// The bytes of a tensor of `sizes` with `elementSize`-byte elements, or nullopt when a
/// size is negative or the product overflows 64 bits: sizes read from a file, checked
/// against the bytes it holds before anything is allocated.
std::optional<uint64_t> tensorBytes(c10::ArrayRef<int64_t> sizes, size_t elementSize);
/// "N bytes", or what a nullopt from tensorBytes means, for messages.
std::string bytesText(std::optional<uint64_t> bytes);
/// Whether a view of `sizes` and `strides` (as many) at element `offset` of a storage of
/// `held` elements lies within it: nothing negative, and its extent, offset +
/// sum((size - 1) * stride) + 1 (0 when a size is 0), at most held without overflow. An
/// expanded view (stride 0) of more elements than the storage fits: LibTorch saves and
/// loads such buffers as views.
bool viewFitsStorage(c10::ArrayRef<int64_t> sizes, c10::ArrayRef<int64_t> strides, int64_t offset,
                     uint64_t held);

/// hddp::StateError beginning with `what` ("state dict /x/model.pt") unless `bytes` ends
/// with a zip directory whose every entry claims no more bytes (compressed or not) than
/// the whole file: LibTorch's zip reader allocates an entry's claimed size before reading
/// it, starting in its constructor. torch.save stores entries uncompressed, and LibTorch's
/// archives compress only their small code files, so no real file is refused.
void checkZipEntrySizes(const std::string& bytes, const std::string& what);

/// The bytes torch.save(OrderedDict(tensors), f) would write (a zip archive with a
/// protocol-2 pickle): torch.load(f, weights_only=True) returns the dict.
std::string torchSaveBytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors);

/// The name -> tensor entries, in order, of a torch.save file of a dict of tensors
/// (model.state_dict(), an OrderedDict with its _metadata, or a plain dict). Each tensor
/// is a view of its storage, as torch.load returns it (tensors that share a storage in
/// the file share it here). hddp::StateError naming `path` when it is something else or
/// claims more than it holds.
std::vector<std::pair<std::string, at::Tensor>> torchLoadBytes(const std::string& bytes,
                                                               const std::string& path);

}  // namespace train
}  // namespace hddp
