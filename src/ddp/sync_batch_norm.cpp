#include "hddp/ddp/sync_batch_norm.h"

#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/torch.h>

#include "hddp/core/error.h"

namespace hddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> reduceDims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

std::vector<int64_t> channelShape(const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = x.size(1);
  return shape;
}

// Sums `parts` (each C or 1 long, float64) across ranks in one collective.
std::vector<at::Tensor> allreduceConcat(Communicator* comm, const std::vector<at::Tensor>& parts) {
  at::Tensor packed = at::cat(parts);
  if (comm && comm->size() > 1) {
    at::Tensor onComm = packed.to(comm->device());
    comm->allreduce(onComm).wait();
    packed = onComm.to(parts[0].device());
  }
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& p : parts) {
    out.push_back(packed.narrow(0, offset, p.numel()));
    offset += p.numel();
  }
  return out;
}

struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, at::Tensor runningMean, at::Tensor runningVar,
                            double eps, double momentum, int64_t commAddress) {
    auto* comm = reinterpret_cast<Communicator*>(commAddress);
    const auto dims = reduceDims(x);
    const int64_t C = x.size(1);
    const double localCount = static_cast<double>(x.numel() / std::max<int64_t>(C, 1));
    at::Tensor x64 = x.to(at::kDouble);
    auto sums = allreduceConcat(
        comm, {x64.sum(dims), (x64 * x64).sum(dims), at::full({1}, localCount, x64.options())});
    const double count = sums[2].item<double>();
    HDDP_CHECK(count > 0, "SyncBatchNorm: the global batch is empty");
    at::Tensor mean = sums[0] / count;
    at::Tensor var = (sums[1] / count - mean * mean).clamp_min(0);
    at::Tensor invstd = (var + eps).rsqrt();
    if (runningMean.defined()) {
      torch::NoGradGuard g;
      const double unbias = count > 1 ? count / (count - 1) : 1.0;
      runningMean.mul_(1 - momentum).add_(mean.to(runningMean.scalar_type()), momentum);
      runningVar.mul_(1 - momentum).add_((var * unbias).to(runningVar.scalar_type()), momentum);
    }
    const auto shape = channelShape(x);
    at::Tensor xhat = ((x64 - mean.view(shape)) * invstd.view(shape)).to(x.scalar_type());
    at::Tensor y = xhat;
    if (weight.defined()) {
      y = xhat * weight.view(shape) + bias.view(shape);
    }
    ctx->save_for_backward({xhat, invstd, weight});
    ctx->saved_data["comm"] = commAddress;
    ctx->saved_data["local_count"] = localCount;
    ctx->saved_data["count"] = count;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& xhat = saved[0];
    const at::Tensor& invstd = saved[1];
    const at::Tensor& weight = saved[2];
    auto* comm = reinterpret_cast<Communicator*>(ctx->saved_data["comm"].toInt());
    const double localCount = ctx->saved_data["local_count"].toDouble();
    const double count = ctx->saved_data["count"].toDouble();
    const at::Tensor dy = grads[0];
    const auto dims = reduceDims(dy);
    const auto shape = channelShape(dy);
    at::Tensor sumDy = dy.to(at::kDouble).sum(dims);
    at::Tensor sumDyXhat = (dy.to(at::kDouble) * xhat.to(at::kDouble)).sum(dims);
    // dy is the gradient of this rank's mean loss; scaled by n_i / N it is the gradient
    // of the global mean loss. Sum those across ranks, then return to this rank's scale
    // (divide by n_i / N) so DistributedDataParallel's b_i / B weighting stays right.
    const double share = localCount / count;
    auto global = allreduceConcat(comm, {sumDy * share, sumDyXhat * share});
    at::Tensor g = weight.defined() ? (invstd * weight.to(at::kDouble)) : invstd;
    at::Tensor dx = (dy.to(at::kDouble) - global[0].view(shape) / localCount -
                     xhat.to(at::kDouble) * global[1].view(shape) / localCount) *
                    g.view(shape);
    at::Tensor dweight;
    at::Tensor dbias;
    if (weight.defined()) {
      dweight = sumDyXhat.to(weight.scalar_type());
      dbias = sumDy.to(weight.scalar_type());
    }
    return {dx.to(dy.scalar_type()),
            dweight,
            dbias,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options, Communicator* communicator)
    : options_(options), communicator_(communicator) {
  HDDP_CHECK(options_.numFeatures > 0, "SyncBatchNorm needs numFeatures > 0, got ",
             options_.numFeatures);
  reset();
}

namespace {

SyncBatchNormOptions fromTorch(const torch::nn::BatchNormOptions& o) {
  HDDP_CHECK_AS(ConfigError, o.momentum().has_value(),
                "SyncBatchNorm: a BatchNorm momentum of nullopt (a cumulative moving average) "
                "is not supported; give a momentum (torch's default is 0.1)");
  SyncBatchNormOptions so(o.num_features());
  so.eps = o.eps();
  so.momentum = *o.momentum();
  so.affine = o.affine();
  so.trackRunningStats = o.track_running_stats();
  return so;
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                                     Communicator* communicator)
    : SyncBatchNormImpl(fromTorch(options), communicator) {}

void SyncBatchNormImpl::reset() {
  if (options_.affine) {
    weight = register_parameter("weight", torch::ones({options_.numFeatures}));
    bias = register_parameter("bias", torch::zeros({options_.numFeatures}));
  }
  if (options_.trackRunningStats) {
    running_mean = register_buffer("running_mean", torch::zeros({options_.numFeatures}));
    running_var = register_buffer("running_var", torch::ones({options_.numFeatures}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  HDDP_CHECK(input.dim() >= 2 && input.size(1) == options_.numFeatures,
             "SyncBatchNorm expects input (N, ", options_.numFeatures, ", ...), got ",
             input.sizes());
  if (!is_training()) {
    // The running statistics where it keeps them; without them the batch's own on this
    // rank alone, as PyTorch's SyncBatchNorm (it syncs in training only): an evaluation
    // that gives the ranks different numbers of batches runs no collective here.
    return torch::batch_norm(input, weight, bias, running_mean, running_var,
                             /*training=*/!running_mean.defined(), options_.momentum, options_.eps,
                             at::globalContext().userEnabledCuDNN());
  }
  if (num_batches_tracked.defined()) {
    torch::NoGradGuard g;
    num_batches_tracked.add_(1);
  }
  return SyncBatchNormFunction::apply(input, weight, bias, running_mean, running_var, options_.eps,
                                      options_.momentum, reinterpret_cast<int64_t>(communicator_));
}

}  // namespace hddp
