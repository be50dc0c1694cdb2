// The pieces of a Trainer state file shared by its save (trainer_state.cpp) and its load
// (trainer_state_load.cpp): archives as bytes, the format's meta record, RNG states and
// who a rank is across generations (internal to the train layer).
#pragma once

#include <ATen/core/Generator.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "train/trainer_state.h"

namespace hddp {
namespace train {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

std::string archiveBytes(OutputArchive& archive);
at::Tensor bytesTensor(const std::vector<uint8_t>& bytes);
std::string tensorBytes(const at::Tensor& t);
/// `into` read from `bytes`, an archive from outside (a state file's payload or an archive
/// inside it) that `what` names ("state file /x/state-00000010.hddp"): checked first
/// (train/archive_check.h), so that LibTorch allocates only what the bytes hold, and
/// LibTorch's own complaints as a StateError beginning with `what` too. `device`: where
/// its tensors go (nullopt: the devices the archive names).
void loadArchive(InputArchive& into, const std::string& bytes, const std::string& what,
                 std::optional<c10::Device> device);
/// The tensor `key` of `archive`; StateError naming `path` when it has none.
at::Tensor readTensor(InputArchive& archive, const std::string& key, const std::string& path);
/// The archive `key` of `archive`; StateError naming `path` when it has none.
void readArchive(InputArchive& archive, const std::string& key, InputArchive& into,
                 const std::string& path);
at::Tensor generatorState(at::Generator gen);
void setGeneratorState(at::Generator gen, const at::Tensor& state);
/// The meta record (format version, step, epoch, ...) as a tensor, and back (StateError
/// naming `path` for another format version).
at::Tensor encode(const StateMeta& m);
StateMeta decode(const at::Tensor& meta, const std::string& path);
/// Who a rank is across generations of an elastic job: its launcher slot (HDDP_SLOT),
/// else -(rank + 1), so that without elasticity rank r is rank r.
int64_t memberId(const StateParts& parts);

}  // namespace train
}  // namespace hddp
