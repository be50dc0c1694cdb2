// LibTorch's own archives checked against the bytes they hold before LibTorch reads them
// (internal to the train layer). A Trainer state file's payload, and the archives nested
// in it (each rank's part, ZeRO's optimizer parts), are what torch::serialize::
// OutputArchive writes: a TorchScript module in a zip (data.pkl, constants.pkl, the
// module's classes as code/*.py, its tensors as data/<key>). LibTorch's loader
// (InputArchive::load_from, torch::jit::load) trusts what those bytes claim: its unpickler
// sizes its memo from an index in the pickle and allocates a string's claimed length before
// reading it (gigabytes for a 27 KB file), reads a storage of any claimed size from a
// smaller record, and views a storage with any sizes and strides. Nothing of that reaches
// LibTorch here: the archive is read first by a pickle machine of its own that builds no
// values (archive_pickle_check.cpp), bounded as DESIGN.md asks ("Readers of outside bytes
// are bounded").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace hddp {
namespace train {

/// How deep values of such an archive may nest. LibTorch frees nested values recursively,
/// so a deep enough pickle (one byte a level) overflows the stack; hddp's archives nest
/// about 10 deep (file, optimizer, its state, a parameter's state, a tensor's arguments).
constexpr size_t kMaxArchiveDepth = 1000;

/// How deep brackets may nest in the archive's code and in a type named by the pickle
/// (`List[Dict[str, Tensor]]`): LibTorch's TorchScript parser recurses once a level.
/// hddp's archives nest 2 deep.
constexpr size_t kMaxArchiveCodeNesting = 32;

/// The largest pickle (data.pkl and the like) hddp reads: hddp's hold the tensors' names
/// and sizes (some 200 bytes a tensor), and checking one takes about 140 bytes of memory
/// per byte (so 9 GB for the largest).
constexpr uint64_t kMaxArchivePickleBytes = uint64_t{64} << 20;

/// hddp::StateError beginning with `what` ("state file /x/state-00000010.hddp") unless
/// `bytes` is an archive LibTorch reads within the bytes it has:
///  - a zip whose entries claim no more than the whole file (checkZipEntrySizes), in
///    today's format (no model.json, which LibTorch reads with a parser of its own);
///  - pickles (*.pkl, *.debug_pkl) of the opcodes and callables LibTorch's unpickler
///    knows, with every length within the bytes left, memo indices below the pickle's
///    size, values nested at most kMaxArchiveDepth deep, each storage no larger than its
///    record, all storages together no larger than the file, each tensor within its
///    storage;
///  - code (*.py) of the lines OutputArchive writes only (class headers, imports,
///    __parameters__ / __buffers__ / __annotations__ lists, `name : Type`, __annotations__["name"]
///    = Type, comments), with types nested at most kMaxArchiveCodeNesting deep: no function (so no
///    __setstate__ for LibTorch to run while loading) and no expression for LibTorch's recursive
///    parser;
///  - pickles of at most kMaxArchivePickleBytes each.
/// Such an archive takes LibTorch about as much memory as it has bytes for its tensors,
/// and for its values up to some 150 bytes per pickle byte (a value per opcode); the check
/// itself takes as much (about 140 bytes per pickle byte), hence the pickles' bound.
void checkTorchArchive(const std::string& bytes, const std::string& what);

/// One pickle `name` of such an archive (checkTorchArchive's second point). `tensorDir`:
/// where its storages' records are ("data/" for data.pkl; empty for a pickle that holds
/// no tensors); `recordSize`: a record's size, or nullopt when the archive lacks it;
/// `storageBudget`: the bytes its storages may still read, lowered by each one.
/// hddp::StateError unless a pickle `name` of `size` bytes is within
/// kMaxArchivePickleBytes.
void checkPickleSize(uint64_t size, const std::string& name, const std::string& what);

void checkArchivePickle(
    const std::string& pickle, const std::string& name, const std::string& tensorDir,
    const std::function<std::optional<uint64_t>(const std::string&)>& recordSize,
    uint64_t& storageBudget, const std::string& what);

}  // namespace train
}  // namespace hddp
