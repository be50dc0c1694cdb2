// torch.save's file format for a dict of tensors, written and read without Python
// (internal to the train layer; hddp/train/state_dict.h uses it for .pt files).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace hddp {
namespace train {

/// torch.save's storage type names (FloatStorage, ...) and the dtypes hddp reads and
/// writes them as.
const std::vector<std::pair<std::string, at::ScalarType>>& torchStorageTypes();

/// The bytes torch.save(OrderedDict(tensors), f) would write (a zip archive with a
/// protocol-2 pickle): torch.load(f, weights_only=True) returns the dict.
std::string torchSaveBytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors);

/// The name -> tensor entries, in order, of a torch.save file of a dict of tensors
/// (model.state_dict(), an OrderedDict with its _metadata, or a plain dict).
/// hddp::StateError naming `path` when it is something else.
std::vector<std::pair<std::string, at::Tensor>> torchLoadBytes(const std::string& bytes,
                                                               const std::string& path);

}  // namespace train
}  // namespace hddp
