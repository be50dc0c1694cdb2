// Model weights in the files Python reads and writes: a plain name -> tensor mapping
// (parameters and buffers, BatchNorm's running statistics and num_batches_tracked
// included), as PyTorch's `model.state_dict()`.
//
//   hddp::saveStateDict(*model, "resnet18.pt");            // torch.load(f, weights_only=True)
//   hddp::saveStateDict(*model, "resnet18.safetensors");   // safetensors.torch.load_file(f)
//   hddp::loadStateDict(*model, "from_python.pt");         // torch.save(model.state_dict(), f)
//
// Formats, by the file's extension:
// - `.safetensors`: an 8-byte little-endian header length, a JSON header (each tensor's
//   dtype, shape and byte range, plus "__metadata__"), then the raw little-endian data;
//   what model hubs publish.
// - anything else (`.pt`, `.pth`, `.bin`): torch.save's format, the zip archive holding a
//   pickle of a dict of tensors (hddp's own writer and reader; LibTorch's pickle functions
//   lose the OrderedDict and write type tags that weights_only refuses).
// State files (hddp/train/state_file.h) are another thing: they hold a whole training
// run's state; these hold the model alone.
//
// Thread safety: free functions; the module must not be used by another thread meanwhile.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace hddp {

/// The module's parameters and buffers by name, on the host, in registration order.
std::vector<std::pair<std::string, at::Tensor>> stateDictOf(const torch::nn::Module& module);

/// Writes `tensors` to `path` (format by extension, see above), atomically (a temporary
/// file renamed into place). hddp::Error naming the path on failure.
void writeStateDict(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                    const std::string& path);
/// Reads every tensor of a state dict file (either format; a pickle file must hold a
/// dict of string -> tensor). hddp::StateError naming the path and what is wrong.
std::map<std::string, at::Tensor> readStateDict(const std::string& path);

/// writeStateDict(stateDictOf(module), path).
void saveStateDict(const torch::nn::Module& module, const std::string& path);

struct LoadStateDictOptions {
  /// Every key of the module must be in the file and every key of the file in the
  /// module, each of the module's shape (PyTorch's strict=True). Default true.
  bool strict = true;
  /// Keys starting with one of these are left out on both sides (fine-tuning with a
  /// new head: {"fc."}). Default none.
  std::vector<std::string> skipPrefixes;
  /// Convert between integer (bool included), floating-point and complex dtypes, e.g.
  /// the file's int32 'fc.weight' into the model's float32, or float into an int64
  /// buffer (truncated). Default false: such a load is a StateError naming the keys and
  /// both dtypes, before anything is copied. Conversions within a kind (float16 or
  /// float64 into float32) are always made, and logged.
  bool allowIntegerFloatConversion = false;
};

struct LoadStateDictResult {
  std::vector<std::string> loaded;
  /// The loaded keys whose dtype differed from the model's, each as
  /// "key (float16 -> float32)" (file -> model); loadStateDict logs them in one warning.
  std::vector<std::string> converted;
  /// With strict = false: the module's keys the file lacks, and the file's keys the
  /// module lacks.
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
};

/// Copies the file's tensors into the module's parameters and buffers (in place: DDP's
/// hooks stay), converting dtype and device to the module's. A tensor whose dtype is
/// not the model's is named in one warning ("converted 2 tensor(s) to the model's dtype:
/// 'fc.weight' (float16 -> float32), ..."; up to 8 keys with a count) and in
/// LoadStateDictResult::converted; one whose conversion would cross between integer,
/// floating-point and complex dtypes is refused unless
/// LoadStateDictOptions::allowIntegerFloatConversion. hddp::StateError naming the file and
/// the missing, unexpected, mis-shaped or refused keys (up to 8 of each, with counts),
/// before anything is copied. A shape mismatch is an error even with strict = false.
LoadStateDictResult loadStateDict(torch::nn::Module& module, const std::string& path,
                                  const LoadStateDictOptions& options = {});

}  // namespace hddp
