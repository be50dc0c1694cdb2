// One rank's training run of a differential-matrix case (diff_matrix_rank.h):
// hddp::DistributedDataParallel with setBatch(local, global) every micro-step, noSync()
// micro-steps, finalize() on a rank without samples, and the options the case draws
// (ZeRO, GradScaler, compression, bf16 autocast, a save and a resume).
#include "diff_matrix_rank.h"

#include <ATen/autocast_mode.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>

#include "diff_matrix_optim.h"
#include "diff_matrix_zoo.h"

namespace diff_matrix {

namespace {

using json = nlohmann::json;

// Every parameter and buffer takes the file's value, dtype included (num_batches_tracked
// stays int64; a case with "autocast" holds float32), before DDP is built: its hooks live
// in the tensors, not in their data. `otherValues`: values that are not the file's (a
// rank other than 0 whose model DDP's broadcast at construction must replace). `frozen`:
// a parameter that gets no gradient.
void loadInitial(torch::nn::Module& model, const Tensors& data, bool otherValues,
                 const std::string& frozen) {
  torch::NoGradGuard noGrad;
  auto take = [&](const std::string& name, at::Tensor& t) {
    auto it = data.find("init/" + name);
    HDDP_CHECK(it != data.end(), "the case has no initial value for '", name, "'");
    t.set_data(it->second.clone());
    if (otherValues) {
      t.fill_(t.is_floating_point() ? 0.25 : 7);
    }
  };
  for (auto& item : model.named_parameters()) {
    take(item.key(), item.value());
    if (item.key() == frozen) {
      item.value().set_requires_grad(false);
    }
  }
  for (auto& item : model.named_buffers()) {
    take(item.key(), item.value());
  }
}

at::Tensor lossOf(const std::string& kind, const at::Tensor& out, const at::Tensor& y) {
  return kind == "ce" ? torch::cross_entropy_loss(out, y) : torch::mse_loss(out, y);
}

// One optimizer step's forward and backward passes on this rank: its share of each
// micro-step, all but the last under noSync(); a rank without samples in the last
// micro-step calls finalize() (and, without samples anywhere, contributes zeros), or with
// "empty_forward" runs forward and backward on no samples (a NaN mean loss) instead.
// With "autocast" the forward and the loss run under bf16 autocast (backward outside, as
// torch.autocast is used).
void backwardOfStep(const json& cfg, const Tensors& data, int s, int rank, Zoo& model,
                    hddp::DistributedDataParallel& ddp, hddp::GradScaler* scaler) {
  const json& step = cfg.at("splits").at(s);
  const json& heads = cfg.at("heads");
  const int micro = cfg.at("micro");
  const bool autocast = cfg.at("autocast");
  int64_t global = 0;
  for (const auto& counts : step) {
    for (const auto& c : counts) {
      global += c.get<int64_t>();
    }
  }
  for (int m = 0; m < micro; ++m) {
    const json& counts = step.at(m);
    int64_t begin = 0;
    for (int r = 0; r < rank; ++r) {
      begin += counts[r].get<int64_t>();
    }
    const int64_t local = counts[rank];
    std::optional<hddp::DistributedDataParallel::NoSyncGuard> guard;
    if (m + 1 < micro) {
      guard.emplace(ddp);
    }
    ddp.setBatch(local, global);
    if (local > 0 || cfg.at("empty_forward")) {
      const std::string key = std::to_string(s) + "/" + std::to_string(m);
      const at::Tensor x = data.at("x/" + key).narrow(0, begin, local);
      const at::Tensor y = data.at("y/" + key).narrow(0, begin, local);
      // An empty forward leaves the head alone: through it, the head would be used (a
      // zero gradient, so weight decay and momentum act) where no sample used it.
      const bool useHead = local > 0 && !heads.is_null() && heads[s][m][rank].get<bool>();
      at::Tensor loss;
      {
        std::optional<hddp::AutocastGuard> amp;
        if (autocast) {
          amp.emplace(c10::kCPU, at::kBFloat16);
        }
        loss = lossOf(cfg.at("loss").get<std::string>(), model->forward(x, useHead), y);
      }
      (scaler ? scaler->scale(loss) : loss).backward();
    } else if (m + 1 == micro) {
      ddp.finalize();  // no samples in the synchronized micro-step
    }
  }
}

void applyCompression(const json& c, hddp::DdpOptions& options) {
  if (c.is_null()) {
    return;
  }
  const std::string kind = c.at("kind");
  if (kind == "fp16") {
    options.compression = hddp::GradCompression::Fp16;
  } else if (kind == "bf16") {
    options.compression = hddp::GradCompression::Bf16;
  } else {
    HDDP_CHECK(kind == "powersgd", "unknown compression '", kind, "'");
    options.compression = hddp::GradCompression::PowerSgd;
    options.powerSgd.rank = c.at("rank");
    options.powerSgd.startStep = c.at("start");
    options.powerSgd.errorFeedback = c.at("error_feedback");
    options.powerSgd.warmStart = c.at("warm_start");
    options.powerSgd.randomSeed = c.at("seed");
    if (c.value("wire", std::string()) == "float32") {
      options.powerSgd.wireType = at::kFloat;
    } else {
      HDDP_CHECK(!c.contains("wire"), "unknown PowerSGD wire '", c.at("wire").dump(), "'");
    }
  }
}

std::string rankFile(const std::string& dir, const char* stem, int rank, const char* ext) {
  return dir + "/" + stem + std::to_string(rank) + ext;
}

std::vector<uint8_t> readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  HDDP_CHECK(in.good(), "cannot read ", path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void writeBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  HDDP_CHECK(out.good(), "cannot write ", path);
}

// What a state file holds, saved at the end of the first phase of a resumed case: the
// model (rank 0: every rank holds the same), the optimizer (rank 0) or each rank's ZeRO
// shard, the GradScaler (rank 0), each rank's PowerSGD state.
void saveState(const std::string& dir, int rank, torch::nn::Module& model,
               torch::optim::Optimizer& opt, hddp::ShardedOptimizer* sharded,
               hddp::GradScaler* scaler, const hddp::DistributedDataParallel& ddp) {
  if (rank == 0) {
    hddp::saveStateDict(model, dir + "/model.safetensors");
    if (!sharded) {
      torch::serialize::OutputArchive archive;
      opt.save(archive);
      archive.save_to(dir + "/optimizer.pt");
    }
    if (scaler) {
      torch::serialize::OutputArchive archive;
      scaler->save(archive);
      archive.save_to(dir + "/scaler.pt");
    }
  }
  if (sharded) {
    writeBytes(rankFile(dir, "shard", rank, ".bin"), sharded->saveShard());
  }
  if (ddp.powerSgdState()) {
    hddp::writeStateDict(ddp.powerSgdState()->stateDict(),
                         rankFile(dir, "powersgd", rank, ".safetensors"));
  }
}

// The optimizer, GradScaler and PowerSGD parts of saveState (the model is loaded before
// DDP is built). ZeRO: every part saved by the first phase's ranks, into this layout.
void loadState(const Phase& phase, int rank, torch::optim::Optimizer& opt,
               hddp::ShardedOptimizer* sharded, hddp::GradScaler* scaler,
               hddp::DistributedDataParallel& ddp) {
  const std::string& dir = phase.loadDir;
  if (sharded) {
    std::vector<std::vector<uint8_t>> parts;
    for (int r = 0; r < phase.savedWorld; ++r) {
      parts.push_back(readBytes(rankFile(dir, "shard", r, ".bin")));
    }
    sharded->loadShards(parts);
  } else {
    torch::serialize::InputArchive archive;
    archive.load_from(dir + "/optimizer.pt");
    opt.load(archive);
  }
  if (scaler) {
    torch::serialize::InputArchive archive;
    archive.load_from(dir + "/scaler.pt");
    scaler->load(archive);
  }
  if (ddp.powerSgdState()) {
    HDDP_CHECK(phase.savedWorld == ddp.communicator().size(),
               "a PowerSGD state resumes on as many ranks as saved it");
    const auto saved = hddp::readStateDict(rankFile(dir, "powersgd", rank, ".safetensors"));
    ddp.powerSgdState()->loadStateDict({saved.begin(), saved.end()});
  }
}

}  // namespace

RankResult runRank(const json& cfg, const Tensors& data, int rank, int size, hddp::Store& store,
                   const Phase& phase) {
  if (cfg.at("autocast")) {
    // The ranks are threads of one process, and autocast's weight cache does not keep
    // them apart: with it, concurrent bf16 forwards come out differently from run to run
    // (pure PyTorch shows it too, docs/reliability.md). Off here and in the reference.
    at::autocast::set_autocast_cache_enabled(false);
  }
  hddp::CommunicatorOptions commOptions;
  if (std::getenv("HDDP_TIMEOUT_SEC") == nullptr) {  // matrix.py sets 20 s; Gloo's is 30 min
    commOptions.timeout = std::chrono::seconds(60);
  }
  commOptions.glooHostname = "127.0.0.1";
  commOptions.glooThreads = 1;
  auto comm = hddp::makeCommunicator(store, rank, size, commOptions);
  const json& dims = cfg.at("dims");
  Zoo model(cfg.at("model").get<std::string>(), dims.at("in"), dims.at("hidden"), dims.at("out"),
            cfg.at("checkpoint"), comm.get());
  const bool resumed = !phase.loadDir.empty();
  loadInitial(*model, data, cfg.at("broadcast") && rank != 0 && !resumed,
              cfg.at("frozen").is_null() ? "" : cfg.at("frozen").get<std::string>());
  if (resumed) {
    hddp::loadStateDict(*model, phase.loadDir + "/model.safetensors");
  }
  model->train();

  const json& d = cfg.at("ddp");
  const int zeroStage = cfg.at("zero").at("stage");
  hddp::DdpOptions ddpOptions;
  ddpOptions.firstBucketBytes = d.at("first_bucket_bytes");
  ddpOptions.bucketCapBytes = d.at("bucket_cap_bytes");
  ddpOptions.gradientAsBucketView = d.at("gradient_as_bucket_view");
  ddpOptions.findUnusedParameters = d.at("find_unused_parameters");
  ddpOptions.rebuildBuckets = d.at("rebuild_buckets");
  const bool syncBeforeForward = d.at("buffer_sync") == "before_forward";
  if (syncBeforeForward) {
    ddpOptions.bufferSync = hddp::BufferSync::BeforeForward;
  } else if (d.at("buffer_sync") == "none") {
    ddpOptions.bufferSync = hddp::BufferSync::None;
  }
  ddpOptions.bufferSyncInterval = d.at("buffer_sync_interval");
  ddpOptions.allocateBucketsLazily = zeroStage > 0;  // as the Trainer does under ZeRO
  applyCompression(cfg.at("compression"), ddpOptions);
  hddp::DistributedDataParallel ddp(model, *comm, ddpOptions);
  const std::vector<at::Tensor> params = hddp::uniqueParameters(*model);
  auto opt = makeOptimizer(cfg.at("optimizer"), *model);
  std::unique_ptr<hddp::ShardedOptimizer> sharded;
  if (zeroStage > 0) {
    hddp::ShardedOptimizerOptions zero;
    zero.stage = zeroStage;
    zero.weights =
        (resumed ? cfg.at("resume") : cfg.at("zero")).at("weights").get<std::vector<double>>();
    zero.gatherChunkBytes = cfg.at("zero").at("gather_chunk_bytes");
    sharded = std::make_unique<hddp::ShardedOptimizer>(ddp, *opt, zero);
  }

  std::unique_ptr<hddp::GradScaler> scaler;
  const json& scaling = cfg.at("scaler");
  if (!scaling.is_null()) {
    hddp::GradScalerOptions so;
    so.initScale = scaling.at("init_scale");
    so.growthInterval = scaling.at("growth_interval");
    scaler = std::make_unique<hddp::GradScaler>(so, comm.get());
  }
  if (resumed) {
    loadState(phase, rank, *opt, sharded.get(), scaler.get(), ddp);
  }
  // The overflow: on the rank that holds the first parameter's summed gradient (ZeRO:
  // its owner; the other ranks' gradients of it are zeros or released).
  const int overflowRank = scaling.is_null() ? -1
                                             : (sharded ? sharded->layout().owner[0]
                                                        : scaling.at("overflow_rank").get<int>());
  const double lrDecay = cfg.at("lr_decay").is_null() ? 1.0 : cfg.at("lr_decay").get<double>();
  torch::optim::Optimizer& stepped = sharded ? sharded->optimizer() : *opt;
  RankResult result;
  for (size_t s = phase.begin; s < phase.end; ++s) {
    if (syncBeforeForward) {
      ddp.syncBuffers();  // before the step's setBatch: weighted by the last step's shares
    }
    if (sharded) {
      sharded->zeroGrad();
    } else {
      opt->zero_grad(cfg.at("zero_grad_to_none"));
    }
    if (rank == 0) {  // rebuilt after the first step only
      json step = {{"buckets", ddp.bucketLayout()}, {"shards", nullptr}};
      if (sharded) {
        const auto names = ddp.parameterNames();
        const hddp::ShardLayout& shards = sharded->layout();
        step["shards"] = json::array();
        for (int r = 0; r < shards.ranks(); ++r) {
          step["shards"].push_back(std::vector<std::string>(names.begin() + shards.begin[r],
                                                            names.begin() + shards.end[r]));
        }
      }
      result.layout.push_back(step);
    }
    backwardOfStep(cfg, data, static_cast<int>(s), rank, model, ddp, scaler.get());
    if (scaler && scaling.at("overflow_step") == s && rank == overflowRank) {
      torch::NoGradGuard noGrad;
      ddp.parameters()[0].grad().view(-1)[0] = std::numeric_limits<double>::infinity();
    }
    if (scaler) {
      scaler->unscale(stepped);
    }
    if (!cfg.at("clip").is_null()) {
      const double maxNorm = cfg.at("clip");
      if (sharded) {
        sharded->clipGradNorm(maxNorm);
      } else {
        torch::nn::utils::clip_grad_norm_(params, maxNorm);
      }
    }
    if (scaler) {
      if (scaler->step(stepped) && sharded) {
        sharded->gatherParameters();
      }
      scaler->update();
    } else if (sharded) {
      sharded->step();
    } else {
      opt->step();
    }
    for (auto& group : opt->param_groups()) {
      group.options().set_lr(group.options().get_lr() * lrDecay);
    }
  }
  if (syncBeforeForward) {
    ddp.syncBuffers();  // what the next step would begin with
  }
  if (!phase.saveDir.empty()) {
    saveState(phase.saveDir, rank, *model, *opt, sharded.get(), scaler.get(), ddp);
  }

  auto& out = result.tensors;
  for (const auto& item : model->named_parameters()) {
    out.emplace_back("param/" + item.key(), item.value().detach().clone());
  }
  for (const auto& item : model->named_buffers()) {
    out.emplace_back("buffer/" + item.key(), item.value().detach().clone());
  }
  addOptimizerState(*opt, ddp, out);
  if (scaler) {
    out.emplace_back("scaler/scale", torch::tensor(scaler->currentScale(), torch::kDouble));
    out.emplace_back("scaler/growth_tracker",
                     torch::tensor(static_cast<double>(scaler->growthTracker()), torch::kDouble));
  }
  return result;
}

}  // namespace diff_matrix
