#include "train/trainer_state.h"

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <vector>

#include "hddp/amp/grad_scaler.h"
#include "hddp/balance/compression_model.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/power_sgd.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "hddp/train/state_file.h"
#include "train/archive_check.h"
#include "train/commit_folders.h"
#include "train/elastic.h"
#include "train/part_state.h"
#include "train/state_archive.h"

namespace hddp {
namespace train {

std::string archiveBytes(OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

at::Tensor bytesTensor(const std::vector<uint8_t>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) {
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  }
  return t;
}

std::string tensorBytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kByte);
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

void loadArchive(InputArchive& into, const std::string& bytes, const std::string& what,
                 std::optional<c10::Device> device) {
  checkTorchArchive(bytes, what);
  try {
    into.load_from(bytes.data(), bytes.size(), device);
  } catch (const c10::Error& e) {
    rethrowIfOutOfMemory();  // host memory for the storages: not the file's fault
    HDDP_THROW(StateError, what, " holds no readable archive (", e.what_without_backtrace(),
               "); resume from an earlier state file");
  } catch (const std::exception& e) {  // TorchScript's parser throws std::runtime_error
    rethrowIfOutOfMemory();
    HDDP_THROW(StateError, what, " holds no readable archive (", e.what(),
               "); resume from an earlier state file");
  }
}

at::Tensor readTensor(InputArchive& archive, const std::string& key, const std::string& path) {
  at::Tensor t;
  HDDP_CHECK_AS(StateError, archive.try_read(key, t), "state file ", path, " has no '", key,
                "' (written by another program or an incompatible hddp version?)");
  return t;
}

void readArchive(InputArchive& archive, const std::string& key, InputArchive& into,
                 const std::string& path) {
  HDDP_CHECK_AS(StateError, archive.try_read(key, into), "state file ", path, " has no '", key,
                "' (written by another program or an incompatible hddp version?)");
}

at::Tensor generatorState(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void setGeneratorState(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  const at::Tensor before = gen.get_state();
  try {
    gen.set_state(state);
  } catch (const c10::Error& e) {  // LibTorch checks what the file's bytes hold
    gen.set_state(before);
    HDDP_THROW(StateError, "its random number generator state is not one (",
               e.what_without_backtrace(), "): the state file is damaged or not hddp's");
  }
}

at::Tensor encode(const StateMeta& m) {
  return at::tensor(std::vector<int64_t>{StateMeta::kVersion, m.step, m.epoch, m.midEpoch ? 1 : 0,
                                         m.worldSize, m.globalBatch},
                    at::kLong);
}

StateMeta decode(const at::Tensor& meta, const std::string& path) {
  const at::Tensor m = meta.contiguous();
  // The file's bytes choose the type: another than the one written is not read as it.
  const int64_t version =
      m.numel() > 0 && m.scalar_type() == at::kLong ? m.data_ptr<int64_t>()[0] : -1;
  HDDP_CHECK_AS(StateError, version == StateMeta::kVersion && m.numel() == 6, "state file ", path,
                " has format version ", version, "; this hddp reads version ", StateMeta::kVersion,
                ". Finish that run with the hddp that wrote it, or start fresh.");
  const int64_t* v = m.data_ptr<int64_t>();
  StateMeta meta_;
  meta_.step = v[1];
  meta_.epoch = v[2];
  meta_.midEpoch = v[3] != 0;
  meta_.worldSize = v[4];
  meta_.globalBatch = v[5];
  return meta_;
}

// Who a rank is across generations of an elastic job: its launcher slot (HDDP_SLOT),
// else -(rank + 1), so that without elasticity rank r is rank r.
int64_t memberId(const StateParts& parts) {
  return parts.slot >= 0 ? parts.slot : -(static_cast<int64_t>(parts.comm.rank()) + 1);
}

namespace {

// This rank's own part of the state: who it is, its RNGs and the planner's window.
// `partsFailed`: set on rank 0 when a part could not give its state.
std::vector<uint8_t> rankBlob(const StateParts& parts, bool& partsFailed) {
  OutputArchive a;
  a.write("member", at::tensor(std::vector<int64_t>{memberId(parts)}, at::kLong));
  if (parts.comm.rank() == 0) {
    // Makes this commit's id (commitIdOf) differ from any other attempt's at the same step.
    // random_device may throw (no entropy source): the clock then, as nothing here may
    // fail on rank 0 alone before the allgather below.
    int64_t nonce = std::chrono::steady_clock::now().time_since_epoch().count();
    try {
      std::random_device entropy;
      nonce ^= (static_cast<int64_t>(entropy()) << 32) ^ entropy();
    } catch (const std::exception&) {
    }
    a.write("commit_nonce", at::tensor(std::vector<int64_t>{nonce}, at::kLong));
    // The Trainer's parts' states (part_state.h), rank 0's, in the bytes every writer
    // gets and the commit id covers. A part that fails to give its state fails the save
    // on every rank at the writers' agreement below, not before the allgather.
    partsFailed = !writePartStatesOrError(a, parts.trainerParts);
  }
  a.write("cpu_rng", generatorState(at::detail::getDefaultCPUGenerator()));
  const c10::Device device = parts.device;
  if (device.type() != c10::kCPU) {
    a.write("device_rng", generatorState(at::globalContext().defaultGenerator(device)));
  }
  if (parts.planner) {
    OutputArchive shared;  // rank 0 writes the shared part into the file itself
    OutputArchive own;
    parts.planner->save(shared, own);
    a.write("planner", own);
  }
  if (parts.powerSgd) {
    OutputArchive powerSgd;
    for (const auto& item : parts.powerSgd->stateDict()) {
      powerSgd.write(item.first, item.second);
    }
    a.write("powersgd", powerSgd);
  }
  const std::string bytes = archiveBytes(a);
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

// One commit's id, the same in every writer's copy: the ranks' gathered parts (rank 0's
// holds a random nonce). The copies' other bytes may differ (each writer's clock in the
// time budget), so a restart compares ids, not bytes (commit_folders.h, chooseCommit).
int64_t commitIdOf(const std::vector<std::vector<uint8_t>>& blobs) {
  std::vector<uint32_t> crcs;
  crcs.reserve(blobs.size());
  for (const auto& blob : blobs) {
    crcs.push_back(crc32Of(blob.data(), blob.size()));
  }
  return static_cast<int64_t>(crc32Of(crcs.data(), crcs.size() * sizeof(uint32_t)));
}

}  // namespace

std::string saveState(const StateParts& parts, const StateMeta& meta,
                      const DistributedSampler::State& sampler, const std::string& directory,
                      int keepLast) {
  bool partsFailed = false;
  const auto blobs = parts.comm.allgatherBytes(rankBlob(parts, partsFailed));
  const std::string path = stateFileName(directory, meta.step);
  // Rank 0 writes, and one rank of each folder it does not share (each rank holds the
  // same parameters, optimizer and shared state; the ranks' own parts were gathered).
  FolderGroups found;
  FolderGroups* groups = parts.folders ? parts.folders : &found;
  // Agreed: a rank whose cache is stale (another folder, or none yet) makes every rank
  // find the groups again; recomputed on some ranks only, the exchanges would not pair.
  if (agreeAny(parts.comm, groups->empty() || groups->dir != directory)) {
    *groups = folderGroups(parts.comm, directory);
  }
  // ZeRO: each rank's part of the optimizer state, for the writers only.
  std::vector<std::vector<uint8_t>> optimizerParts;
  if (parts.sharded) {
    optimizerParts =
        partsToWriters(parts.comm, parts.sharded->saveShard(), groups->writes(parts.comm.rank()));
  }
  // Each writer's outcome reaches every rank: a full disk on one node fails the save on
  // all of them, not the next collective on the others.
  RankOutcome problem;
  if (groups->writes(parts.comm.rank())) try {
      OutputArchive archive;
      archive.write("meta", encode(meta));
      archive.write("commit_id", at::tensor(std::vector<int64_t>{commitIdOf(blobs)}, at::kLong));
      const StateMeta::Progress& g = meta.progress;
      archive.write(
          "progress",
          at::tensor(
              std::vector<double>{g.epochLossSum, static_cast<double>(g.epochSamples),
                                  static_cast<double>(g.epochSteps), g.budgetSeconds,
                                  g.budgetEvaluationSeconds, static_cast<double>(g.budgetStartStep),
                                  static_cast<double>(g.budgetSteps)},
              at::kDouble));
      // Flat, by name: loading copies into the parameters (Module::load would replace
      // them, which detaches DDP's gradient hooks).
      for (const auto& item : parts.model.named_parameters(/*recurse=*/true)) {
        archive.write("model." + item.key(), item.value().detach().cpu());
      }
      for (const auto& item : parts.model.named_buffers(/*recurse=*/true)) {
        archive.write("buffer." + item.key(), item.value().detach().cpu());
      }
      if (parts.sharded) {
        OutputArchive zero;
        zero.write("parts", at::tensor(static_cast<int64_t>(optimizerParts.size())));
        for (size_t r = 0; r < optimizerParts.size(); ++r) {
          auto& bytes = optimizerParts[r];
          zero.write(
              "part" + std::to_string(r),
              at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, at::kByte).clone());
        }
        archive.write("zero", zero);
      } else {
        OutputArchive optimizerArchive;
        parts.optimizer.save(optimizerArchive);
        archive.write("optimizer", optimizerArchive);
      }
      OutputArchive scalerArchive;
      parts.scaler.save(scalerArchive);
      archive.write("scaler", scalerArchive);
      sampler.save(archive);
      if (parts.planner) {
        OutputArchive shared;
        OutputArchive own;  // each rank's own part travels in its blob
        parts.planner->save(shared, own);
        archive.write("planner", shared);
      }
      if (!parts.compression.empty()) {
        archive.write("compression", bytesTensor(std::vector<uint8_t>(parts.compression.begin(),
                                                                      parts.compression.end())));
      }
      if (parts.ddp) {
        std::string order;
        for (const auto& name : parts.ddp->bucketOrder()) {
          order += name + "\n";
        }
        archive.write("ddp_order", bytesTensor(std::vector<uint8_t>(order.begin(), order.end())));
      }
      if (!parts.runId.empty()) {
        archive.write("run_id",
                      bytesTensor(std::vector<uint8_t>(parts.runId.begin(), parts.runId.end())));
      }
      if (partsFailed || parts.comm.rank() != 0) {  // rank 0 knows; another writer reads it
        checkPartStatesSaved(blobs[0]);
      }
      for (size_t r = 0; r < blobs.size(); ++r) {
        archive.write("rank" + std::to_string(r), bytesTensor(blobs[r]));
      }
      writeStateFile(path, archiveBytes(archive));
      pruneStateFiles(directory, keepLast);
      HDDP_LOG_INFO("train", "saved step ", meta.step, " to ", path);
    } catch (...) {  // whatever it is, every rank hears of it below
      problem = currentFailure();
    }
  const auto outcomes = allgatherOutcomes(parts.comm, problem);
  for (size_t r = 0; r < outcomes.size(); ++r) {
    HDDP_CHECK_AS(StateError, !outcomes[r].failed(), "saving step ", meta.step, " failed on rank ",
                  r, ": ", outcomes[r].message);
  }
  return path;
}

}  // namespace train
}  // namespace hddp
