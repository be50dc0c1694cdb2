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
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hddp/hddp.h"

namespace {

using json = nlohmann::json;

// A Linear whose weight may be another layer's tensor (tied), as Python's
// `dec.weight = enc.weight`: the same names (weight, bias) and arithmetic (F.linear).
struct DenseImpl : torch::nn::Module {
  DenseImpl(int64_t in, int64_t out, const at::Tensor& tiedWeight = {}, bool withBias = true) {
    weight = register_parameter(
        "weight", tiedWeight.defined() ? tiedWeight : torch::zeros({out, in}, torch::kDouble));
    if (withBias) {
      bias = register_parameter("bias", torch::zeros({out}, torch::kDouble));
    }
  }
  at::Tensor forward(const at::Tensor& x) { return torch::linear(x, weight, bias); }
  at::Tensor weight, bias;
};
TORCH_MODULE(Dense);

// tools/diff-matrix/zoo.py's Zoo: the same modules, registered in the same order.
struct ZooImpl : torch::nn::Module {
  ZooImpl(const std::string& kind, const json& dims, hddp::Communicator* comm) : kind(kind) {
    const int64_t in = dims.at("in"), hidden = dims.at("hidden"), out = dims.at("out");
    const bool normalized = kind == "bn" || kind == "syncbn";  // fc1 without bias (zoo.py)
    fc1 = register_module("fc1", Dense(in, hidden, at::Tensor(), !normalized));
    if (kind == "bn") {
      bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    } else if (kind == "syncbn") {
      syncBn = register_module("bn", hddp::SyncBatchNorm(hddp::SyncBatchNormOptions(hidden), comm));
    } else if (kind == "tied") {
      enc = register_module("enc", Dense(hidden, hidden));
      dec = register_module("dec", Dense(hidden, hidden, enc->weight));
    }
    fc2 = register_module("fc2", Dense(hidden, out));
    if (kind == "unused") {
      head = register_module("head", Dense(in, out));
    }
  }
  at::Tensor forward(const at::Tensor& x, bool useHead) {
    at::Tensor h = fc1(x);
    if (bn) {
      h = bn(h);
    } else if (syncBn) {
      h = syncBn(h);
    }
    h = torch::tanh(h);
    if (enc) {
      h = torch::tanh(dec(torch::tanh(enc(h))));
    }
    at::Tensor y = fc2(h);
    if (head && useHead) {
      y = y + head(x);
    }
    return y;
  }
  std::string kind;
  Dense fc1{nullptr}, enc{nullptr}, dec{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  hddp::SyncBatchNorm syncBn{nullptr};
};
TORCH_MODULE(Zoo);

using Tensors = std::map<std::string, at::Tensor>;

// Every parameter and buffer takes the file's value, dtype included (num_batches_tracked
// stays int64), before DDP is built: its hooks live in the tensors, not in their data.
void loadInitial(torch::nn::Module& model, const Tensors& data) {
  torch::NoGradGuard noGrad;
  auto take = [&](const std::string& name, at::Tensor& t) {
    auto it = data.find("init/" + name);
    HDDP_CHECK(it != data.end(), "the case has no initial value for '", name, "'");
    t.set_data(it->second.clone());
  };
  for (auto& item : model.named_parameters()) {
    take(item.key(), item.value());
  }
  for (auto& item : model.named_buffers()) {
    take(item.key(), item.value());
  }
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const json& o,
                                                       const std::vector<at::Tensor>& params) {
  const std::string kind = o.at("kind");
  const double lr = o.at("lr");
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr)
                                                           .momentum(o.at("momentum"))
                                                           .dampening(o.at("dampening"))
                                                           .nesterov(o.at("nesterov"))
                                                           .weight_decay(o.at("weight_decay")));
  }
  const std::tuple<double, double> betas{o.at("betas").at(0), o.at("betas").at(1)};
  if (kind == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr)
                                                            .betas(betas)
                                                            .eps(o.at("eps"))
                                                            .weight_decay(o.at("weight_decay"))
                                                            .amsgrad(o.at("amsgrad")));
  }
  HDDP_CHECK(kind == "adamw", "unknown optimizer '", kind, "'");
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr)
                                                           .betas(betas)
                                                           .eps(o.at("eps"))
                                                           .weight_decay(o.at("weight_decay"))
                                                           .amsgrad(o.at("amsgrad")));
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

// One rank's whole run of the case; returns what it writes.
std::vector<std::pair<std::string, at::Tensor>> runRank(const json& cfg, const Tensors& data,
                                                        int rank, int size, hddp::Store& store) {
  hddp::CommunicatorOptions commOptions;
  commOptions.timeout = std::chrono::seconds(60);
  commOptions.glooHostname = "127.0.0.1";
  commOptions.glooThreads = 1;
  auto comm = hddp::makeCommunicator(store, rank, size, commOptions);
  Zoo model(cfg.at("model").get<std::string>(), cfg.at("dims"), comm.get());
  loadInitial(*model, data);
  model->train();

  const json& d = cfg.at("ddp");
  const int zeroStage = cfg.at("zero").at("stage");
  hddp::DdpOptions ddpOptions;
  ddpOptions.firstBucketBytes = d.at("first_bucket_bytes");
  ddpOptions.bucketCapBytes = d.at("bucket_cap_bytes");
  ddpOptions.gradientAsBucketView = d.at("gradient_as_bucket_view");
  ddpOptions.findUnusedParameters = d.at("find_unused_parameters");
  ddpOptions.allocateBucketsLazily = zeroStage > 0;  // as the Trainer does under ZeRO
  hddp::DistributedDataParallel ddp(model, *comm, ddpOptions);
  const std::vector<at::Tensor> params = hddp::uniqueParameters(*model);
  auto opt = makeOptimizer(cfg.at("optimizer"), params);
  std::unique_ptr<hddp::ShardedOptimizer> sharded;
  if (zeroStage > 0) {
    hddp::ShardedOptimizerOptions zero;
    zero.stage = zeroStage;
    zero.weights = cfg.at("zero").at("weights").get<std::vector<double>>();
    sharded = std::make_unique<hddp::ShardedOptimizer>(ddp, *opt, zero);
  }

  const std::string loss = cfg.at("loss");
  const json& splits = cfg.at("splits");
  const json& heads = cfg.at("heads");
  const bool toNone = cfg.at("zero_grad_to_none");
  const int micro = cfg.at("micro");
  for (size_t s = 0; s < splits.size(); ++s) {
    if (sharded) {
      sharded->zeroGrad();
    } else {
      opt->zero_grad(toNone);
    }
    int64_t global = 0;
    for (const auto& counts : splits[s]) {
      for (const auto& c : counts) {
        global += c.get<int64_t>();
      }
    }
    for (int m = 0; m < micro; ++m) {
      const json& counts = splits[s][m];
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
      if (local > 0) {
        const std::string key = std::to_string(s) + "/" + std::to_string(m);
        const at::Tensor x = data.at("x/" + key).narrow(0, begin, local);
        const at::Tensor y = data.at("y/" + key).narrow(0, begin, local);
        const bool useHead = !heads.is_null() && heads[s][m][rank].get<bool>();
        lossOf(loss, model->forward(x, useHead), y).backward();
      } else if (m + 1 == micro) {
        ddp.finalize();  // no samples in the synchronized micro-step
      }
    }
    if (!cfg.at("clip").is_null()) {
      const double maxNorm = cfg.at("clip");
      if (sharded) {
        sharded->clipGradNorm(maxNorm);
      } else {
        torch::nn::utils::clip_grad_norm_(params, maxNorm);
      }
    }
    if (sharded) {
      sharded->step();
    } else {
      opt->step();
    }
  }

  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model->named_parameters()) {
    out.emplace_back("param/" + item.key(), item.value().detach().clone());
  }
  for (const auto& item : model->named_buffers()) {
    out.emplace_back("buffer/" + item.key(), item.value().detach().clone());
  }
  addOptimizerState(*opt, ddp, out);
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
  fs::remove_all(outDir);
  fs::create_directories(outDir);
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
