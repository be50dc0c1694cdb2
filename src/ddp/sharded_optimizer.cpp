// ShardedOptimizer (hddp/ddp/sharded_optimizer.h): ZeRO stages 1 and 2 with shards of
// unequal size.
#include "hddp/ddp/sharded_optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <sstream>
#include <unordered_map>

#include "ddp/sharded_optimizer_impl.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"

namespace hddp {

namespace zero {

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

}  // namespace zero

using zero::bytesOf;
using zero::kindName;
using zero::kindOf;
using zero::stateTensorBytes;

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

ShardedOptimizer::Impl::Impl(DistributedDataParallel& ddp, torch::optim::Optimizer& optimizer,
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
  // Cut the optimizer down to this rank's shard; state of other parameters goes. Which
  // group held each parameter is kept: state files record it for every shard.
  groupOf_.assign(params_.size(), -1);
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    std::vector<at::Tensor> kept;
    for (const auto& p : group.params()) {
      const auto found = index.find(p.unsafeGetTensorImpl());
      HDDP_CHECK_AS(ConfigError, found != index.end(),
                    "ShardedOptimizer: the optimizer holds a tensor of shape ", p.sizes(),
                    " that DistributedDataParallel does not synchronize (frozen, or not in "
                    "the model); build the optimizer from the model's trainable parameters");
      groupOf_[static_cast<size_t>(found->second)] = static_cast<int>(g);
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

// Every rank must shard alike (the same stage, owners and gather chunks), or the
// reductions and broadcasts would not match: the settings are compared across ranks,
// and a difference is a ConfigError on every rank.
void ShardedOptimizer::Impl::checkRanksAgree() {
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

// Each owner broadcasts its parameters. A tensor of at least a chunk goes in place
// (no copy); smaller ones travel together through a buffer of up to a chunk. The
// broadcasts are launched back to back and waited for at the end (a round trip per
// chunk would serialise them), with at most two chunk buffers held at a time.
void ShardedOptimizer::Impl::gatherParameters() {
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

double ShardedOptimizer::Impl::clipGradNorm(double maxNorm) {
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

void ShardedOptimizer::Impl::zeroGrad() {
  for (auto& p : params_) {
    p.mutable_grad() = at::Tensor();
  }
}

int64_t ShardedOptimizer::Impl::stateBytes() const {
  int64_t total = 0;
  for (const auto& item : optimizer_.state()) {
    total += stateTensorBytes(*item.second);
  }
  return total;
}

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
