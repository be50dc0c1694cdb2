// ShardedOptimizer (hddp/ddp/sharded_optimizer.h): ZeRO stages 1 and 2 with shards of
// unequal size.
#include "hddp/ddp/sharded_optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <unordered_map>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"

namespace hddp {

namespace {

std::string elementsText(int64_t n) {
  std::ostringstream os;
  os.precision(3);
  if (n >= 1000000) {
    os << static_cast<double>(n) / 1e6 << " M";
  } else if (n >= 1000) {
    os << static_cast<double>(n) / 1e3 << " k";
  } else {
    os << n;
  }
  return os.str();
}

enum class OptimizerKind { Sgd, Adam, AdamW };

OptimizerKind kindOf(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr) {
    return OptimizerKind::Sgd;
  }
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr) {
    return OptimizerKind::AdamW;
  }
  if (dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr) {
    return OptimizerKind::Adam;
  }
  HDDP_THROW(ConfigError,
             "ShardedOptimizer (ZeRO) shards torch::optim::SGD, Adam and AdamW, whose update is "
             "per element and whose state it saves and loads per parameter. This optimizer is "
             "none of them (LBFGS, RMSprop, Adagrad or your own); train it without --zero / "
             "ShardedOptimizer");
}

std::unique_ptr<torch::optim::OptimizerParamState> newState(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::Sgd:
      return std::make_unique<torch::optim::SGDParamState>();
    case OptimizerKind::Adam:
      return std::make_unique<torch::optim::AdamParamState>();
    case OptimizerKind::AdamW:
      return std::make_unique<torch::optim::AdamWParamState>();
  }
  return nullptr;
}

int64_t bytesOf(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

int64_t stateTensorBytes(const torch::optim::OptimizerParamState& state) {
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    return bytesOf(s->momentum_buffer());
  }
  if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    return bytesOf(s->exp_avg()) + bytesOf(s->exp_avg_sq()) + bytesOf(s->max_exp_avg_sq());
  }
  if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    return bytesOf(s->exp_avg()) + bytesOf(s->exp_avg_sq()) + bytesOf(s->max_exp_avg_sq());
  }
  return 0;
}

// Moves a loaded state's tensors to the parameter's device.
void moveState(torch::optim::OptimizerParamState& state, const at::Tensor& param) {
  auto to = [&](const at::Tensor& t) { return t.defined() ? t.to(param.device()) : t; };
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    s->momentum_buffer(to(s->momentum_buffer()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    s->exp_avg(to(s->exp_avg()));
    s->exp_avg_sq(to(s->exp_avg_sq()));
    s->max_exp_avg_sq(to(s->max_exp_avg_sq()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    s->exp_avg(to(s->exp_avg()));
    s->exp_avg_sq(to(s->exp_avg_sq()));
    s->max_exp_avg_sq(to(s->max_exp_avg_sq()));
  }
}

const char* kindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::Sgd:
      return "sgd";
    case OptimizerKind::Adam:
      return "adam";
    case OptimizerKind::AdamW:
      return "adamw";
  }
  return "?";
}

}  // namespace

int64_t optimizerStateBytes(const torch::optim::Optimizer& optimizer) {
  auto& o = const_cast<torch::optim::Optimizer&>(optimizer);
  if (dynamic_cast<torch::optim::SGD*>(&o) == nullptr &&
      dynamic_cast<torch::optim::Adam*>(&o) == nullptr &&
      dynamic_cast<torch::optim::AdamW*>(&o) == nullptr) {
    return -1;
  }
  int64_t total = 0;
  for (const auto& item : optimizer.state()) {
    total += stateTensorBytes(*item.second);
  }
  return total;
}

std::string ShardLayout::describe() const {
  int64_t total = 0;
  for (int64_t e : elements) {
    total += e;
  }
  std::ostringstream os;
  os.precision(3);
  for (int r = 0; r < ranks(); ++r) {
    os << (r ? "; " : "") << "rank " << r << ": " << (end[r] - begin[r]) << " tensor(s), "
       << elementsText(elements[r]) << " elements ("
       << (total > 0 ? 100.0 * static_cast<double>(elements[r]) / static_cast<double>(total) : 0.0)
       << "%)";
  }
  return os.str();
}

ShardLayout shardLayout(const std::vector<int64_t>& numels, const std::vector<double>& weights) {
  HDDP_CHECK_AS(ConfigError, !weights.empty(), "shardLayout: no weights (one per rank)");
  double sum = 0;
  for (size_t r = 0; r < weights.size(); ++r) {
    HDDP_CHECK_AS(ConfigError, std::isfinite(weights[r]) && weights[r] >= 0,
                  "shard weights must be finite and >= 0; rank ", r, "'s is ", weights[r]);
    sum += weights[r];
  }
  HDDP_CHECK_AS(ConfigError, sum > 0, "shard weights are all 0: no rank would own anything");
  const int n = static_cast<int>(weights.size());
  int64_t total = 0;
  for (int64_t e : numels) {
    total += e;
  }
  // Rank r's part of the element line is [bound[r], bound[r+1]).
  std::vector<double> bound(static_cast<size_t>(n) + 1, 0.0);
  for (int r = 0; r < n; ++r) {
    bound[r + 1] = bound[r] + static_cast<double>(total) * weights[r] / sum;
  }
  bound[n] = static_cast<double>(total) + 1.0;  // the last tensor always has an owner
  ShardLayout layout;
  layout.owner.resize(numels.size());
  layout.begin.assign(n, 0);
  layout.end.assign(n, 0);
  layout.elements.assign(n, 0);
  int64_t start = 0;
  int rank = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const double mid = static_cast<double>(start) + static_cast<double>(numels[i]) / 2.0;
    while (rank + 1 < n && mid >= bound[rank + 1]) {
      ++rank;
    }
    layout.owner[i] = rank;
    layout.elements[rank] += numels[i];
    start += numels[i];
  }
  // Ranges from the owners (contiguous by construction); an empty rank's range is empty
  // at the place where it would begin.
  int next = 0;
  for (int r = 0; r < n; ++r) {
    layout.begin[r] = next;
    while (next < static_cast<int>(numels.size()) && layout.owner[next] == r) {
      ++next;
    }
    layout.end[r] = next;
  }
  HDDP_INTERNAL_ASSERT(next == static_cast<int>(numels.size()), "shard ranges are not contiguous");
  return layout;
}

ShardBy parseShardBy(const std::string& text) {
  ShardBy by;
  if (text == "memory") {
    by.kind = ShardBy::Kind::Memory;
    return by;
  }
  if (text == "equal") {
    by.kind = ShardBy::Kind::Equal;
    return by;
  }
  by.kind = ShardBy::Kind::Ratios;
  std::stringstream in(text);
  std::string item;
  double sum = 0;
  while (std::getline(in, item, ':')) {
    char* endp = nullptr;
    const double v = std::strtod(item.c_str(), &endp);
    HDDP_CHECK_AS(ConfigError,
                  !item.empty() && endp != nullptr && *endp == '\0' && std::isfinite(v) && v >= 0,
                  "--shard-by '", text, "': '", item,
                  "' is not a number >= 0. Give memory, equal, or one ratio per rank (1:3)");
    by.ratios.push_back(v);
    sum += v;
  }
  HDDP_CHECK_AS(ConfigError, !by.ratios.empty() && sum > 0, "--shard-by '", text,
                "': give memory, equal, or one ratio per rank, not all 0 (1:3)");
  return by;
}

std::string describeShardBy(const ShardBy& by) {
  switch (by.kind) {
    case ShardBy::Kind::Memory:
      return "memory";
    case ShardBy::Kind::Equal:
      return "equal";
    case ShardBy::Kind::Ratios: {
      std::ostringstream os;
      for (size_t i = 0; i < by.ratios.size(); ++i) {
        os << (i ? ":" : "") << by.ratios[i];
      }
      return os.str();
    }
  }
  return "?";
}

std::vector<double> memoryShardWeights(Communicator& communicator, double freeBytes) {
  // Gathered first and checked after, on every rank alike: a check before the
  // collective would fail one rank while the others wait in it.
  std::vector<uint8_t> mine(sizeof(double));
  std::memcpy(mine.data(), &freeBytes, sizeof(double));
  const auto all = communicator.allgatherBytes(mine);
  std::vector<double> weights;
  double sum = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    HDDP_INTERNAL_ASSERT(all[r].size() == sizeof(double), "a rank's free bytes are not a double");
    double v = 0;
    std::memcpy(&v, all[r].data(), sizeof(double));
    HDDP_CHECK_AS(ConfigError, std::isfinite(v), "memoryShardWeights: rank ", r,
                  " reports free bytes ", v, ", not a number");
    weights.push_back(std::max(0.0, v));
    sum += weights.back();
  }
  HDDP_CHECK_AS(ConfigError, sum > 0,
                "sharding by memory: no rank reports free device memory after the model. Give "
                "the shares with --shard-by R0:R1:... (or equal), or an emulated total with "
                "--emulate-memory");
  return weights;
}

class ShardedOptimizer::Impl {
 public:
  Impl(DistributedDataParallel& ddp, torch::optim::Optimizer& optimizer,
       ShardedOptimizerOptions options)
      : ddp_(ddp), comm_(ddp.communicator()), optimizer_(optimizer), options_(std::move(options)) {
    HDDP_CHECK_AS(ConfigError, options_.stage == 1 || options_.stage == 2,
                  "ShardedOptimizer: ZeRO stage ", options_.stage,
                  " is not one this runs; give 1 (optimizer state) or 2 (and gradients)");
    HDDP_CHECK_AS(ConfigError, options_.gatherChunkBytes > 0,
                  "ShardedOptimizer: gatherChunkBytes must be positive, got ",
                  options_.gatherChunkBytes);
    kind_ = kindOf(optimizer_);
    params_ = ddp_.parameters();
    names_ = ddp_.parameterNames();
    std::vector<double> weights = options_.weights;
    if (weights.empty()) {
      weights.assign(static_cast<size_t>(comm_.size()), 1.0);
    }
    HDDP_CHECK_AS(ConfigError, static_cast<int>(weights.size()) == comm_.size(),
                  "ShardedOptimizer: ", weights.size(), " shard weights for ", comm_.size(),
                  " ranks; give one per rank (--shard-by R0:R1:...)");
    std::vector<int64_t> numels;
    std::unordered_map<const void*, int> index;
    for (size_t i = 0; i < params_.size(); ++i) {
      numels.push_back(params_[i].numel());
      index.emplace(params_[i].unsafeGetTensorImpl(), static_cast<int>(i));
      byName_.emplace(names_[i], static_cast<int>(i));
    }
    layout_ = shardLayout(numels, weights);
    checkRanksAgree();
    const int rank = comm_.rank();
    // Cut the optimizer down to this rank's shard; state of other parameters goes.
    for (auto& group : optimizer_.param_groups()) {
      std::vector<at::Tensor> kept;
      for (const auto& p : group.params()) {
        const auto found = index.find(p.unsafeGetTensorImpl());
        HDDP_CHECK_AS(ConfigError, found != index.end(),
                      "ShardedOptimizer: the optimizer holds a tensor of shape ", p.sizes(),
                      " that DistributedDataParallel does not synchronize (frozen, or not in "
                      "the model); build the optimizer from the model's trainable parameters");
        if (layout_.owner[static_cast<size_t>(found->second)] == rank) {
          kept.push_back(p);
        } else {
          optimizer_.state().erase(p.unsafeGetTensorImpl());
        }
      }
      group.params() = std::move(kept);
    }
    ddp_.setGradientOwners(layout_.owner, options_.stage == 2);
    HDDP_LOG_INFO("ddp", "ZeRO-", options_.stage, " (", kindName(kind_), "): ", layout_.describe());
  }

  // Each owner broadcasts its parameters. A tensor of at least a chunk goes in place
  // (no copy); smaller ones travel together through a buffer of up to a chunk. The
  // broadcasts are launched back to back and waited for at the end (a round trip per
  // chunk would serialise them), with at most two chunk buffers held at a time.
  // Every rank must shard alike (the same stage, owners and gather chunks), or the
  // reductions and broadcasts would not match: the settings are compared across ranks,
  // and a difference is a ConfigError on every rank.
  void checkRanksAgree() {
    std::ostringstream digest;
    digest << "stage " << options_.stage << ", gather chunk " << options_.gatherChunkBytes
           << " bytes, optimizer " << kindName(kind_) << ", owners";
    for (int r = 0; r < layout_.ranks(); ++r) {
      digest << " " << layout_.begin[r] << "-" << layout_.end[r];
    }
    const std::string mine = digest.str();
    const auto all = comm_.allgatherBytes(std::vector<uint8_t>(mine.begin(), mine.end()));
    const std::string first(all[0].begin(), all[0].end());
    for (size_t r = 1; r < all.size(); ++r) {
      const std::string theirs(all[r].begin(), all[r].end());
      HDDP_CHECK_AS(ConfigError, theirs == first,
                    "ShardedOptimizer: the ranks do not shard alike: rank 0 has ", first, "; rank ",
                    r, " has ", theirs,
                    ". Give every rank the same --zero, --shard-by and bucket size");
    }
  }

  void gatherParameters() {
    if (comm_.size() == 1) {
      return;
    }
    at::NoGradGuard noGrad;
    const int rank = comm_.rank();
    struct Pending {
      Work work;
      at::Tensor buffer;  // undefined: in place
      int first = 0;
      int end = 0;
    };
    std::vector<Pending> pending;
    size_t buffersHeld = 0;
    auto finish = [&](Pending& p) {
      p.work.wait();
      if (p.buffer.defined()) {
        if (rank != layout_.owner[static_cast<size_t>(p.first)]) {
          int64_t offset = 0;
          for (int k = p.first; k < p.end; ++k) {
            const int64_t n = params_[k].numel();
            params_[k].detach().copy_(p.buffer.narrow(0, offset, n).view(params_[k].sizes()));
            offset += n;
          }
        }
        p.buffer = at::Tensor();
        --buffersHeld;
      }
    };
    size_t waited = 0;
    for (int r = 0; r < layout_.ranks(); ++r) {
      int i = layout_.begin[r];
      while (i < layout_.end[r]) {
        // A chunk: parameters of one dtype up to gatherChunkBytes (at least one).
        int j = i;
        int64_t bytes = 0;
        int64_t elements = 0;
        const auto dtype = params_[i].scalar_type();
        while (j < layout_.end[r] && params_[j].scalar_type() == dtype &&
               (j == i || bytes + bytesOf(params_[j]) <= options_.gatherChunkBytes)) {
          bytes += bytesOf(params_[j]);
          elements += params_[j].numel();
          ++j;
        }
        Pending p;
        p.first = i;
        p.end = j;
        if (j == i + 1 && params_[i].is_contiguous()) {
          at::Tensor in = params_[i].detach();
          p.work = comm_.broadcast(in, r);
        } else {
          while (buffersHeld >= 2 && waited < pending.size()) {
            finish(pending[waited++]);
          }
          if (rank == r) {
            std::vector<at::Tensor> views;
            for (int k = i; k < j; ++k) {
              views.push_back(params_[k].detach().reshape({-1}));
            }
            p.buffer = at::cat(views);
          } else {
            p.buffer = at::empty({elements}, params_[i].options().requires_grad(false));
          }
          ++buffersHeld;
          p.work = comm_.broadcast(p.buffer, r);
        }
        pending.push_back(std::move(p));
        i = j;
      }
    }
    for (; waited < pending.size(); ++waited) {
      finish(pending[waited]);
    }
  }

  double clipGradNorm(double maxNorm) {
    HDDP_CHECK(std::isfinite(maxNorm) && maxNorm > 0, "clipGradNorm: the maximum norm must be a ",
               "positive number, got ", maxNorm);
    const int rank = comm_.rank();
    at::NoGradGuard noGrad;
    const c10::Device device = params_.empty() ? c10::Device(c10::kCPU) : params_[0].device();
    at::Tensor squares = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
    std::vector<at::Tensor> grads;
    for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
      const at::Tensor& g = params_[i].grad();
      if (g.defined()) {
        grads.push_back(g);
        squares += g.norm(2).to(at::kDouble).pow(2);
      }
    }
    comm_.allreduce(squares).wait();
    comm_.synchronize();
    const double total = std::sqrt(squares.item<double>());
    const double coefficient = maxNorm / (total + 1e-6);
    if (coefficient < 1.0) {
      for (auto& g : grads) {
        g.mul_(coefficient);
      }
    }
    return total;
  }

  void zeroGrad() {
    for (auto& p : params_) {
      p.mutable_grad() = at::Tensor();
    }
  }

  int64_t stateBytes() const {
    int64_t total = 0;
    for (const auto& item : optimizer_.state()) {
      total += stateTensorBytes(*item.second);
    }
    return total;
  }

  std::vector<uint8_t> saveShard() const {
    torch::serialize::OutputArchive archive;
    archive.write("format", at::tensor(int64_t{1}));
    archive.write("optimizer", at::tensor(static_cast<int64_t>(kind_)));
    const int rank = comm_.rank();
    std::vector<int64_t> indices;
    std::vector<int64_t> numels;
    for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
      const auto found = optimizer_.state().find(params_[i].unsafeGetTensorImpl());
      if (found == optimizer_.state().end()) {
        continue;
      }
      torch::serialize::OutputArchive one;
      found->second->serialize(one);
      archive.write("p" + std::to_string(i), one);
      indices.push_back(i);
      numels.push_back(params_[i].numel());
    }
    archive.write("parameters", at::tensor(indices, at::kLong));
    archive.write("numels", at::tensor(numels, at::kLong));
    std::string names;
    for (int64_t i : indices) {
      names += names_[static_cast<size_t>(i)] + "\n";
    }
    archive.write(
        "names",
        at::from_blob(names.data(), {static_cast<int64_t>(names.size())}, at::kByte).clone());
    std::ostringstream out;
    archive.save_to(out);
    const std::string s = out.str();
    return std::vector<uint8_t>(s.begin(), s.end());
  }

  void loadShards(const std::vector<std::vector<uint8_t>>& parts) {
    const int rank = comm_.rank();
    // Parameters of this shard lose the state they had: the parts are the truth.
    for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
      optimizer_.state().erase(params_[i].unsafeGetTensorImpl());
    }
    for (size_t part = 0; part < parts.size(); ++part) {
      torch::serialize::InputArchive archive;
      const auto& bytes = parts[part];
      archive.load_from(reinterpret_cast<const char*>(bytes.data()), bytes.size(),
                        c10::Device(c10::kCPU));
      at::Tensor kind;
      archive.read("optimizer", kind);
      HDDP_CHECK_AS(StateError, kind.item<int64_t>() == static_cast<int64_t>(kind_),
                    "optimizer state part ", part, " was saved by a ",
                    kindName(static_cast<OptimizerKind>(kind.item<int64_t>())),
                    " optimizer; this one is ", kindName(kind_));
      at::Tensor indices;
      at::Tensor numels;
      archive.read("parameters", indices);
      archive.read("numels", numels);
      // By name: a parameter frozen or unfrozen since the save shifts the indices.
      at::Tensor nameBytes;
      archive.read("names", nameBytes);
      std::vector<std::string> savedNames;
      {
        const auto* data = nameBytes.data_ptr<uint8_t>();
        std::stringstream in(std::string(data, data + nameBytes.numel()));
        std::string line;
        while (std::getline(in, line)) {
          savedNames.push_back(line);
        }
      }
      HDDP_CHECK_AS(StateError, static_cast<int64_t>(savedNames.size()) == indices.numel(),
                    "optimizer state part ", part, " names ", savedNames.size(), " parameters for ",
                    indices.numel(), " states");
      for (int64_t k = 0; k < indices.numel(); ++k) {
        const std::string& name = savedNames[static_cast<size_t>(k)];
        const auto found = byName_.find(name);
        HDDP_CHECK_AS(StateError, found != byName_.end(), "optimizer state part ", part,
                      " holds the state of '", name,
                      "', which this model does not train (renamed, or frozen now)");
        const int64_t i = found->second;
        HDDP_CHECK_AS(StateError, i >= 0 && i < static_cast<int64_t>(params_.size()),
                      "optimizer state part ", part, " holds parameter ", i, "; this model has ",
                      params_.size(), " trainable parameters");
        HDDP_CHECK_AS(StateError, numels[k].item<int64_t>() == params_[i].numel(),
                      "optimizer state part ", part, ": parameter ", i, " ('", names_[i], "') has ",
                      numels[k].item<int64_t>(), " elements there and ", params_[i].numel(),
                      " in this model");
        if (layout_.owner[static_cast<size_t>(i)] != rank) {
          continue;
        }
        torch::serialize::InputArchive one;
        archive.read("p" + std::to_string(indices[k].item<int64_t>()), one);
        auto state = newState(kind_);
        state->serialize(one);
        moveState(*state, params_[i]);
        optimizer_.state()[params_[i].unsafeGetTensorImpl()] = std::move(state);
      }
    }
  }

  DistributedDataParallel& ddp_;
  Communicator& comm_;
  torch::optim::Optimizer& optimizer_;
  ShardedOptimizerOptions options_;
  OptimizerKind kind_ = OptimizerKind::Sgd;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, int> byName_;
  ShardLayout layout_;
};

ShardedOptimizer::ShardedOptimizer(DistributedDataParallel& ddp, torch::optim::Optimizer& optimizer,
                                   ShardedOptimizerOptions options)
    : impl_(std::make_unique<Impl>(ddp, optimizer, std::move(options))) {}
ShardedOptimizer::~ShardedOptimizer() = default;

void ShardedOptimizer::step() {
  impl_->optimizer_.step();
  impl_->gatherParameters();
}
void ShardedOptimizer::gatherParameters() { impl_->gatherParameters(); }
double ShardedOptimizer::clipGradNorm(double maxNorm) { return impl_->clipGradNorm(maxNorm); }
void ShardedOptimizer::zeroGrad() { impl_->zeroGrad(); }
torch::optim::Optimizer& ShardedOptimizer::optimizer() { return impl_->optimizer_; }
const ShardLayout& ShardedOptimizer::layout() const { return impl_->layout_; }
int ShardedOptimizer::stage() const { return impl_->options_.stage; }
int64_t ShardedOptimizer::stateBytes() const { return impl_->stateBytes(); }
std::vector<uint8_t> ShardedOptimizer::saveShard() const { return impl_->saveShard(); }
void ShardedOptimizer::loadShards(const std::vector<std::vector<uint8_t>>& parts) {
  impl_->loadShards(parts);
}

}  // namespace hddp
