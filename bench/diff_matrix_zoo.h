// The model zoo of the differential matrix (tools/diff-matrix/zoo.py defines the same
// models in Python: the same module, parameter and buffer names, registered in the same
// order, and the same arithmetic). bench/diff_matrix.cpp trains them.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "hddp/hddp.h"

namespace diff_matrix {

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
  ZooImpl(const std::string& kind, int64_t in, int64_t hidden, int64_t out, bool checkpointed,
          hddp::Communicator* comm)
      : kind(kind), checkpointed(checkpointed) {
    std::set<std::string> parts;  // "syncbn+tied+unused" -> its parts; "mlp": none
    for (size_t at = 0; at <= kind.size();) {
      const size_t plus = std::min(kind.find('+', at), kind.size());
      parts.insert(kind.substr(at, plus - at));
      at = plus + 1;
    }
    const bool normalized = parts.count("bn") || parts.count("syncbn");  // fc1 without bias
    fc1 = register_module("fc1", Dense(in, hidden, at::Tensor(), !normalized));
    if (parts.count("bn")) {
      bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    } else if (parts.count("syncbn")) {
      syncBn = register_module("bn", hddp::SyncBatchNorm(hddp::SyncBatchNormOptions(hidden), comm));
    }
    if (parts.count("tied")) {
      enc = register_module("enc", Dense(hidden, hidden));
      dec = register_module("dec", Dense(hidden, hidden, enc->weight));
    }
    fc2 = register_module("fc2", Dense(hidden, out));
    if (parts.count("unused")) {
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
      auto block = [this](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{torch::tanh(dec(torch::tanh(enc(in[0]))))};
      };
      h = checkpointed ? hddp::checkpoint(block, {h}, {enc->weight, enc->bias, dec->bias})[0]
                       : block({h})[0];
    }
    auto last = [this](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{fc2(in[0])};
    };
    at::Tensor y =
        checkpointed && !enc ? hddp::checkpoint(last, {h}, fc2->parameters())[0] : last({h})[0];
    if (head && useHead) {
      y = y + head(x);
    }
    return y;
  }
  std::string kind;
  bool checkpointed;
  Dense fc1{nullptr}, enc{nullptr}, dec{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  hddp::SyncBatchNorm syncBn{nullptr};
};
TORCH_MODULE(Zoo);

}  // namespace diff_matrix
