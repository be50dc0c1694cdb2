// The C++ side of the differential matrix against PyTorch (tools/diff-matrix/matrix.py,
// docs/reliability.md): trains each case folder's configuration on N ranks (threads of
// this process over an in-memory store, Gloo on the CPU) in float64 with
// hddp::DistributedDataParallel (setBatch(local, global) every micro-step, noSync()
// micro-steps, a rank without samples calling finalize()) and an optional
// hddp::ShardedOptimizer, and writes each rank's final state for the reference to read.
//
//   diff_matrix CASE_DIR...
//
// Reads CASE_DIR/case.json and CASE_DIR/data.safetensors (tools/diff-matrix/cases.py
// says what they hold); writes CASE_DIR/out/rank<r>.safetensors with `param/<name>` (a
// tied tensor under each of its names), `buffer/<name>` and `state/<name>/<key>` (the
// optimizer state this rank holds: momentum_buffer; step, exp_avg, exp_avg_sq,
// max_exp_avg_sq), or CASE_DIR/out/error.txt when a rank threw. Exit code 1 when any case
// failed to run (a disagreement with the reference is matrix.py's to find).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "diff_matrix_zoo.h"
#include "hddp/hddp.h"

namespace {

using json = nlohmann::json;
using diff_matrix::Zoo;

using Tensors = std::map<std::string, at::Tensor>;

// Every parameter and buffer takes the file's value, dtype included (num_batches_tracked
// stays int64), before DDP is built: its hooks live in the tensors, not in their data.
// `otherValues`: values that are not the file's (a rank other than 0 whose model DDP's
// broadcast at construction must replace). `frozen`: a parameter that gets no gradient.
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

std::unique_ptr<torch::optim::OptimizerOptions> optionsOf(const json& o, double lr, double decay) {
  const std::string kind = o.at("kind");
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(lr)
                                                          .momentum(o.at("momentum"))
                                                          .dampening(o.at("dampening"))
                                                          .nesterov(o.at("nesterov"))
                                                          .weight_decay(decay));
  }
  const std::tuple<double, double> betas{o.at("betas").at(0), o.at("betas").at(1)};
  if (kind == "adam") {
    return std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(lr)
                                                           .betas(betas)
                                                           .eps(o.at("eps"))
                                                           .weight_decay(decay)
                                                           .amsgrad(o.at("amsgrad")));
  }
  HDDP_CHECK(kind == "adamw", "unknown optimizer '", kind, "'");
  return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr)
                                                          .betas(betas)
                                                          .eps(o.at("eps"))
                                                          .weight_decay(decay)
                                                          .amsgrad(o.at("amsgrad")));
}

// reference.py's make_optimizer: one group, or a second one holding fc2's and head's
// parameters with their own learning rate and weight decay. A tied tensor once.
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const json& o, torch::nn::Module& model) {
  std::vector<at::Tensor> first, second;
  std::set<const void*> seen;
  const bool grouped = o.contains("second_group") && !o.at("second_group").is_null();
  for (const auto& item : model.named_parameters()) {
    if (!item.value().requires_grad() || !seen.insert(item.value().unsafeGetTensorImpl()).second) {
      continue;  // frozen (ZeRO takes only what DDP synchronizes), or tied and seen
    }
    const std::string top = item.key().substr(0, item.key().find('.'));
    (grouped && (top == "fc2" || top == "head") ? second : first).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(first);
  if (!second.empty()) {
    const json& g = o.at("second_group");
    groups.emplace_back(second,
                        optionsOf(o, o.at("lr").get<double>() * g.at("lr_scale").get<double>(),
                                  g.at("weight_decay")));
  }
  auto defaults = optionsOf(o, o.at("lr"), o.at("weight_decay"));
  const std::string kind = o.at("kind");
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(groups,
                                               static_cast<torch::optim::SGDOptions&>(*defaults));
  }
  if (kind == "adam") {
    return std::make_unique<torch::optim::Adam>(groups,
                                                static_cast<torch::optim::AdamOptions&>(*defaults));
  }
  return std::make_unique<torch::optim::AdamW>(groups,
                                               static_cast<torch::optim::AdamWOptions&>(*defaults));
}

// The optimizer state this rank holds, under the names torch.optim's state_dict uses.
void addOptimizerState(torch::optim::Optimizer& opt, const hddp::DistributedDataParallel& ddp,
                       std::vector<std::pair<std::string, at::Tensor>>& out) {
  const auto params = ddp.parameters();
  const auto names = ddp.parameterNames();
  auto& state = opt.state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(params[i].unsafeGetTensorImpl());
    if (it == state.end()) {
      continue;
    }
    const std::string prefix = "state/" + names[i] + "/";
    auto put = [&](const char* key, const at::Tensor& t) {
      if (t.defined()) {
        out.emplace_back(prefix + key, t.detach().clone());
      }
    };
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      put("momentum_buffer", sgd->momentum_buffer());
    } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      put("step", torch::tensor(static_cast<double>(adam->step()), torch::kDouble));
      put("exp_avg", adam->exp_avg());
      put("exp_avg_sq", adam->exp_avg_sq());
      put("max_exp_avg_sq", adam->max_exp_avg_sq());
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      put("step", torch::tensor(static_cast<double>(adamw->step()), torch::kDouble));
      put("exp_avg", adamw->exp_avg());
      put("exp_avg_sq", adamw->exp_avg_sq());
      put("max_exp_avg_sq", adamw->max_exp_avg_sq());
    } else {
      HDDP_CHECK(false, "optimizer state of an unknown kind for '", names[i], "'");
    }
  }
}

at::Tensor lossOf(const std::string& kind, const at::Tensor& out, const at::Tensor& y) {
  return kind == "ce" ? torch::cross_entropy_loss(out, y) : torch::mse_loss(out, y);
}

// One optimizer step's forward and backward passes on this rank: its share of each
// micro-step, all but the last under noSync(); a rank without samples in the last
// micro-step calls finalize() (and, without samples anywhere, contributes zeros), or with
// "empty_forward" runs forward and backward on no samples (a NaN mean loss) instead.
void backwardOfStep(const json& cfg, const Tensors& data, int s, int rank, Zoo& model,
                    hddp::DistributedDataParallel& ddp, hddp::GradScaler* scaler) {
  const json& step = cfg.at("splits").at(s);
  const json& heads = cfg.at("heads");
  const int micro = cfg.at("micro");
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
      at::Tensor loss = lossOf(cfg.at("loss").get<std::string>(), model->forward(x, useHead), y);
      (scaler ? scaler->scale(loss) : loss).backward();
    } else if (m + 1 == micro) {
      ddp.finalize();  // no samples in the synchronized micro-step
    }
  }
}

// One rank's whole run of the case; returns what it writes.
std::vector<std::pair<std::string, at::Tensor>> runRank(const json& cfg, const Tensors& data,
                                                        int rank, int size, hddp::Store& store) {
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
  loadInitial(*model, data, cfg.at("broadcast") && rank != 0,
              cfg.at("frozen").is_null() ? "" : cfg.at("frozen").get<std::string>());
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
  hddp::DistributedDataParallel ddp(model, *comm, ddpOptions);
  const std::vector<at::Tensor> params = hddp::uniqueParameters(*model);
  auto opt = makeOptimizer(cfg.at("optimizer"), *model);
  std::unique_ptr<hddp::ShardedOptimizer> sharded;
  if (zeroStage > 0) {
    hddp::ShardedOptimizerOptions zero;
    zero.stage = zeroStage;
    zero.weights = cfg.at("zero").at("weights").get<std::vector<double>>();
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
  // The overflow: on the rank that holds the first parameter's summed gradient (ZeRO:
  // its owner; the other ranks' gradients of it are zeros or released).
  const int overflowRank = scaling.is_null() ? -1
                                             : (sharded ? sharded->layout().owner[0]
                                                        : scaling.at("overflow_rank").get<int>());
  const double lrDecay = cfg.at("lr_decay").is_null() ? 1.0 : cfg.at("lr_decay").get<double>();
  torch::optim::Optimizer& stepped = sharded ? sharded->optimizer() : *opt;
  for (size_t s = 0; s < cfg.at("splits").size(); ++s) {
    if (syncBeforeForward) {
      ddp.syncBuffers();  // before the step's setBatch: weighted by the last step's shares
    }
    if (sharded) {
      sharded->zeroGrad();
    } else {
      opt->zero_grad(cfg.at("zero_grad_to_none"));
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

  std::vector<std::pair<std::string, at::Tensor>> out;
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
  return out;
}

std::string readText(const std::string& path) {
  std::ifstream in(path);
  HDDP_CHECK(in.good(), "cannot read ", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs one case folder; returns false when a rank threw (error.txt says why).
bool runCase(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path outDir = fs::path(dir) / "out";
  fs::create_directories(outDir);
  for (const auto& entry : fs::directory_iterator(outDir)) {
    fs::remove(entry.path());  // not fs::remove_all: it resolves to libtorch's copy, which crashes
  }
  std::vector<std::string> errors;
  std::string caseError;
  try {
    const json cfg = json::parse(readText((fs::path(dir) / "case.json").string()));
    const Tensors data = hddp::readStateDict((fs::path(dir) / "data.safetensors").string());
    const int size = cfg.at("world");
    hddp::Store store = hddp::Store::memory(std::chrono::seconds(60));
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> results(size);
    errors.assign(size, "");
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        try {
          hddp::Store mine = store;
          results[r] = runRank(cfg, data, r, size, mine);
        } catch (const c10::Error& e) {
          errors[r] = e.what_without_backtrace();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) {
      t.join();
    }
    for (int r = 0; r < size; ++r) {
      if (errors[r].empty()) {
        hddp::writeStateDict(results[r],
                             (outDir / ("rank" + std::to_string(r) + ".safetensors")).string());
      }
    }
  } catch (const c10::Error& e) {
    caseError = e.what_without_backtrace();
  } catch (const std::exception& e) {
    caseError = e.what();
  }
  std::string message = caseError.empty() ? "" : "case: " + caseError + "\n";
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) {
      message += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
    }
  }
  if (!message.empty()) {
    std::ofstream((outDir / "error.txt").string()) << message;
    std::fprintf(stderr, "%s: %s", dir.c_str(), message.c_str());
  }
  return message.empty();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    std::printf(
        "usage: diff_matrix CASE_DIR...\n(tools/diff-matrix/matrix.py makes the case "
        "folders and runs this; docs/reliability.md)\n");
    return argc < 2 ? 2 : 0;
  }
  at::set_num_threads(1);  // ranks are threads already; the float64 sums stay in one order
  int failed = 0;
  for (int i = 1; i < argc; ++i) {
    failed += runCase(argv[i]) ? 0 : 1;
  }
  return failed > 0 ? 1 : 0;
}
