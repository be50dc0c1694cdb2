#include "resnet.h"

#include <torch/nn/functional.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/pooling.h>

#include "hddp/checkpoint/checkpoint.h"
#include "hddp/core/error.h"
#include "hddp/ddp/sync_batch_norm.h"

namespace hddp {
namespace models {
namespace {

namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).bias(false));
}

void addNorm(nn::Sequential& seq, int64_t channels, bool sync) {
  if (sync) {
    seq->push_back(SyncBatchNorm(channels));
  } else {
    seq->push_back(nn::BatchNorm2d(channels));
  }
}

struct BlockImpl : nn::Module {
  BlockImpl(int64_t in, int64_t width, int64_t stride, bool bottleneck, bool sync) {
    const int64_t out = bottleneck ? width * 4 : width;
    nn::Sequential b;
    if (bottleneck) {
      b->push_back(conv(in, width, 1, 1));
      addNorm(b, width, sync);
      b->push_back(nn::ReLU(true));
      b->push_back(conv(width, width, 3, stride));
      addNorm(b, width, sync);
      b->push_back(nn::ReLU(true));
      b->push_back(conv(width, out, 1, 1));
      addNorm(b, out, sync);
    } else {
      b->push_back(conv(in, width, 3, stride));
      addNorm(b, width, sync);
      b->push_back(nn::ReLU(true));
      b->push_back(conv(width, out, 3, 1));
      addNorm(b, out, sync);
    }
    body = register_module("body", b);
    if (stride != 1 || in != out) {
      nn::Sequential sc;
      sc->push_back(conv(in, out, 1, stride));
      addNorm(sc, out, sync);
      shortcut = register_module("shortcut", sc);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = body->forward(x);
    return torch::relu(y + (shortcut ? shortcut->forward(x) : x));
  }
  nn::Sequential body{nullptr};
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(Block);

// torchvision's BasicBlock and Bottleneck (ResNet v1.5: the stride on the 3x3 conv),
// with its names: conv1, bn1, conv2, bn2[, conv3, bn3][, downsample.0, downsample.1].
struct TorchvisionBlockImpl : nn::Module {
  TorchvisionBlockImpl(int64_t in, int64_t width, int64_t stride, bool bottleneck, bool sync) {
    const int64_t out = bottleneck ? width * 4 : width;
    if (bottleneck) {
      conv1 = register_module("conv1", conv(in, width, 1, 1));
      bn1 = norm("bn1", width, sync);
      conv2 = register_module("conv2", conv(width, width, 3, stride));
      bn2 = norm("bn2", width, sync);
      conv3 = register_module("conv3", conv(width, out, 1, 1));
      bn3 = norm("bn3", out, sync);
    } else {
      conv1 = register_module("conv1", conv(in, width, 3, stride));
      bn1 = norm("bn1", width, sync);
      conv2 = register_module("conv2", conv(width, out, 3, 1));
      bn2 = norm("bn2", out, sync);
    }
    if (stride != 1 || in != out) {
      nn::Sequential ds;
      ds->push_back(conv(in, out, 1, stride));
      addNorm(ds, out, sync);
      downsample = register_module("downsample", ds);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::relu(bn1.forward(conv1->forward(x)));
    y = bn2.forward(conv2->forward(y));
    if (conv3) {
      y = bn3.forward(conv3->forward(torch::relu(y)));
    }
    return torch::relu(y + (downsample ? downsample->forward(x) : x));
  }
  nn::AnyModule norm(const std::string& name, int64_t channels, bool sync) {
    nn::AnyModule m =
        sync ? nn::AnyModule(SyncBatchNorm(channels)) : nn::AnyModule(nn::BatchNorm2d(channels));
    register_module(name, m.ptr());
    return m;
  }
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  nn::AnyModule bn1, bn2, bn3;
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(TorchvisionBlock);

// Runs block `b` of `stage`, recomputed in backward (hddp::checkpoint).
template <typename BlockImplT>
torch::Tensor checkpointedBlock(nn::Sequential& stage, size_t b, torch::Tensor x) {
  auto block = stage->ptr(b);
  auto* impl = stage[b]->as<BlockImplT>();
  return checkpoint(
      [impl](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{impl->forward(in[0])};
      },
      {x}, block->parameters())[0];
}

// x + body(x), two 3x3 conv-norm-ReLU layers (the residual of ResNet-9).
struct ResidualImpl : nn::Module {
  ResidualImpl(int64_t channels, bool sync) {
    nn::Sequential b;
    for (int i = 0; i < 2; ++i) {
      b->push_back(conv(channels, channels, 3, 1));
      addNorm(b, channels, sync);
      b->push_back(nn::ReLU(true));
    }
    body = register_module("body", b);
  }
  torch::Tensor forward(torch::Tensor x) { return x + body->forward(x); }
  nn::Sequential body{nullptr};
};
TORCH_MODULE(Residual);

void addConvNormRelu(nn::Sequential& seq, int64_t in, int64_t out, bool sync) {
  seq->push_back(conv(in, out, 3, 1));
  addNorm(seq, out, sync);
  seq->push_back(nn::ReLU(true));
}

}  // namespace

ResNetStem parseResNetStem(const std::string& name) {
  if (name == "auto") {
    return ResNetStem::Auto;
  }
  if (name == "cifar") {
    return ResNetStem::Cifar;
  }
  HDDP_CHECK(name == "torchvision", "unknown ResNet stem '", name,
             "'; use auto, cifar (3x3 conv, no max-pool) or torchvision (7x7/2 conv, max-pool)");
  return ResNetStem::Torchvision;
}

bool isResNetArch(const std::string& arch) {
  for (const char* a :
       {"resnet9", "resnet20", "resnet32", "resnet56", "resnet18", "resnet34", "resnet50"}) {
    if (arch == a) {
      return true;
    }
  }
  return false;
}

ResNetImpl::ResNetImpl(const ResNetOptions& o) {
  HDDP_CHECK(isResNetArch(o.arch), "unknown ResNet '", o.arch,
             "'; use resnet9, resnet20, resnet32, resnet56, resnet18, resnet34 or resnet50");
  HDDP_CHECK(o.inChannels > 0 && o.numClasses > 1 && o.imageSize >= 8,
             "bad ResNet options: ", o.inChannels, " input channels, ", o.numClasses, " classes, ",
             o.imageSize, " px");
  checkpoint_ = o.checkpointActivations;
  const bool cifar = o.arch == "resnet20" || o.arch == "resnet32" || o.arch == "resnet56";
  HDDP_CHECK(!(o.stem == ResNetStem::Torchvision && (cifar || o.arch == "resnet9")),
             "the torchvision stem is for resnet18, resnet34 and resnet50; ", o.arch,
             " has its own 3x3 stem (use the auto or cifar stem)");
  if (o.arch == "resnet9") {
    buildResNet9(o);
    return;
  }
  std::vector<int64_t> blocks;
  std::vector<int64_t> widths;
  bool bottleneck = false;
  int64_t stemWidth = 64;
  if (cifar) {
    const int64_t n = o.arch == "resnet20" ? 3 : o.arch == "resnet32" ? 5 : 9;
    blocks = {n, n, n};
    widths = {16, 32, 64};
    stemWidth = 16;
  } else {
    blocks =
        o.arch == "resnet18" ? std::vector<int64_t>{2, 2, 2, 2} : std::vector<int64_t>{3, 4, 6, 3};
    widths = {64, 128, 256, 512};
    bottleneck = o.arch == "resnet50";
  }
  const bool small =
      cifar || o.stem == ResNetStem::Cifar || (o.stem == ResNetStem::Auto && o.imageSize <= 64);
  const int64_t stemKernel = small ? 3 : 7;
  const int64_t stemStride = small ? 1 : 2;
  torchvision_ = !cifar;
  if (torchvision_) {
    // torchvision's names: conv1, bn1, layer1..layer4, fc.
    conv1_ = register_module("conv1", conv(o.inChannels, stemWidth, stemKernel, stemStride));
    bn1_ = o.syncBatchNorm ? nn::AnyModule(SyncBatchNorm(stemWidth))
                           : nn::AnyModule(nn::BatchNorm2d(stemWidth));
    register_module("bn1", bn1_.ptr());
    stemMaxPool_ = !small;
  } else {
    nn::Sequential stem;
    stem->push_back(conv(o.inChannels, stemWidth, stemKernel, stemStride));
    addNorm(stem, stemWidth, o.syncBatchNorm);
    stem->push_back(nn::ReLU(true));
    stages_.push_back(register_module("stem", stem));
  }
  int64_t in = stemWidth;
  for (size_t s = 0; s < blocks.size(); ++s) {
    nn::Sequential stage;
    for (int64_t b = 0; b < blocks[s]; ++b) {
      const int64_t stride = (b == 0 && s > 0) ? 2 : 1;
      if (torchvision_) {
        stage->push_back(TorchvisionBlock(in, widths[s], stride, bottleneck, o.syncBatchNorm));
      } else {
        stage->push_back(Block(in, widths[s], stride, bottleneck, o.syncBatchNorm));
      }
      in = bottleneck ? widths[s] * 4 : widths[s];
    }
    stages_.push_back(
        register_module((torchvision_ ? "layer" : "stage") + std::to_string(s + 1), stage));
  }
  fc_ = register_module("fc", nn::Linear(in, o.numClasses));
  initConvs();
}

void ResNetImpl::buildResNet9(const ResNetOptions& o) {
  // Page's ResNet-9 (DAWNBench, 2018) at a quarter of its width: stem 16; stages of
  // 32 (+ residual), 64, 128 (+ residual), each a conv and a 2x2 max-pool; global
  // max-pool. Half of ResNet-20's multiply-adds at 28 px, in 8 conv layers against 19.
  const bool sync = o.syncBatchNorm;
  nn::Sequential stem;
  addConvNormRelu(stem, o.inChannels, 16, sync);
  stages_.push_back(register_module("stem", stem));
  const int64_t widths[] = {32, 64, 128};
  int64_t in = 16;
  for (int s = 0; s < 3; ++s) {
    nn::Sequential stage;
    addConvNormRelu(stage, in, widths[s], sync);
    stage->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
    if (s != 1) {
      stage->push_back(Residual(widths[s], sync));
    }
    in = widths[s];
    stages_.push_back(register_module("stage" + std::to_string(s + 1), stage));
  }
  fc_ = register_module("fc", nn::Linear(in, o.numClasses));
  maxPoolHead_ = true;
  initConvs();
}

void ResNetImpl::initConvs() {
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    }
  }
}

torch::Tensor ResNetImpl::forward(torch::Tensor x) {
  if (torchvision_) {
    x = torch::relu(bn1_.forward(conv1_->forward(x)));
    if (stemMaxPool_) {
      x = torch::max_pool2d(x, {3, 3}, {2, 2}, {1, 1});
    }
  }
  const bool checkpointing = checkpoint_ && is_training();
  for (size_t s = 0; s < stages_.size(); ++s) {
    const bool stem = !torchvision_ && s == 0;
    if (!checkpointing || stem) {
      x = stages_[s]->forward(x);
      continue;
    }
    if (maxPoolHead_) {  // ResNet-9: a stage is a few layers, recomputed whole
      torch::nn::SequentialImpl* stage = stages_[s].get();
      x = checkpoint(
          [stage](const std::vector<torch::Tensor>& in) {
            return std::vector<torch::Tensor>{stage->forward(in[0])};
          },
          {x}, stage->parameters())[0];
      continue;
    }
    for (size_t b = 0; b < stages_[s]->size(); ++b) {
      x = torchvision_ ? checkpointedBlock<TorchvisionBlockImpl>(stages_[s], b, x)
                       : checkpointedBlock<BlockImpl>(stages_[s], b, x);
    }
  }
  x = (maxPoolHead_ ? std::get<0>(torch::adaptive_max_pool2d(x, {1, 1}))
                    : torch::adaptive_avg_pool2d(x, {1, 1}))
          .flatten(1);
  return fc_->forward(x);
}

}  // namespace models
}  // namespace hddp
