// A model's profile from the model itself (hddp/train/model_profile.h): FLOPs from the
// dispatched operators' shapes, activation memory from the CPU allocator's reports,
// and an optional timed calibration.
#include "hddp/train/model_profile.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>

#include "hddp/core/autocast.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

double numel(const c10::IValue& v) {
  return v.isTensor() ? static_cast<double>(v.toTensor().numel()) : 0.0;
}

// Product of a tensor's sizes from dimension 2 on (a convolution's spatial extent).
double spatial(const c10::IValue& v) {
  if (!v.isTensor()) {
    return 0.0;
  }
  double s = 1.0;
  const auto sizes = v.toTensor().sizes();
  for (size_t d = 2; d < sizes.size(); ++d) {
    s *= static_cast<double>(sizes[d]);
  }
  return s;
}

double dim(const c10::IValue& v, int64_t d) {
  return v.isTensor() ? static_cast<double>(v.toTensor().size(d)) : 0.0;
}

// 2 x multiply-adds of a matrix product a[..., M, K] x b[..., K, N].
double matmulFlops(const c10::IValue& a, const c10::IValue& b) {
  if (!a.isTensor() || !b.isTensor() || a.toTensor().dim() < 2) {
    return 0.0;
  }
  const double batch = numel(a) / (dim(a, -2) * dim(a, -1));
  return 2.0 * batch * dim(a, -2) * dim(a, -1) * dim(b, -1);
}

// A convolution's forward FLOPs from its input, weight and output (or grad_output).
double convolutionFlops(const c10::IValue& input, const c10::IValue& weight,
                        const c10::IValue& output, bool transposed) {
  const double n = dim(input, 0);
  return 2.0 * n * numel(weight) * (transposed ? spatial(input) : spatial(output));
}

enum class Counted { None, Forward, Backward };

struct Counter {
  std::mutex mutex;
  double forward = 0.0;
  double backward = 0.0;
  bool inBackward = false;
};
Counter* gCounter = nullptr;
thread_local int tCountedDepth = 0;  // a counted operator is running on this thread

struct CountedContext : at::ObserverContext {
  bool counted = false;
  // A forward convolution's FLOPs need its output's shape, known at the end; its inputs
  // are only seen at the start: 2 x N x weight elements, times the input's spatial
  // extent when transposed (pending = 0 then), else the output's.
  double pending = 0.0;
};

bool isCounted(const char* name) {
  static const char* const kNames[] = {"aten::convolution", "aten::convolution_backward",
                                       "aten::mm",          "aten::addmm",
                                       "aten::bmm",         "aten::baddbmm"};
  for (const char* n : kNames) {
    if (std::strcmp(name, n) == 0) {
      return true;
    }
  }
  return false;
}

std::unique_ptr<at::ObserverContext> onStart(const at::RecordFunction& fn) {
  auto ctx = std::make_unique<CountedContext>();
  const char* name = fn.name();
  if (gCounter == nullptr || !isCounted(name) || tCountedDepth > 0) {
    return ctx;
  }
  ctx->counted = true;
  ++tCountedDepth;
  const auto in = fn.inputs();
  double flops = 0.0;
  if (std::strcmp(name, "aten::mm") == 0 || std::strcmp(name, "aten::bmm") == 0) {
    flops = matmulFlops(in[0], in[1]);
  } else if (std::strcmp(name, "aten::addmm") == 0 || std::strcmp(name, "aten::baddbmm") == 0) {
    flops = matmulFlops(in[1], in[2]);
  } else if (std::strcmp(name, "aten::convolution_backward") == 0) {
    // (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    //  output_padding, groups, output_mask): each of grad_input and grad_weight costs
    // the forward's products.
    const bool transposed = in[7].toBool();
    const auto mask = in[10].toBoolList();
    const double forward = convolutionFlops(in[1], in[2], in[0], transposed);
    flops = forward * ((mask.get(0) ? 1.0 : 0.0) + (mask.get(1) ? 1.0 : 0.0));
  } else if (std::strcmp(name, "aten::convolution") == 0) {
    // (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    if (in[6].toBool()) {
      flops = convolutionFlops(in[0], in[1], in[0], /*transposed=*/true);
    } else {
      ctx->pending = 2.0 * dim(in[0], 0) * numel(in[1]);
    }
  }
  if (flops > 0) {
    std::lock_guard<std::mutex> lock(gCounter->mutex);
    (gCounter->inBackward ? gCounter->backward : gCounter->forward) += flops;
  }
  return ctx;
}

void onEnd(const at::RecordFunction& fn, at::ObserverContext* base) {
  auto* ctx = static_cast<CountedContext*>(base);
  if (ctx == nullptr || !ctx->counted) {
    return;
  }
  --tCountedDepth;
  const auto& out = fn.outputs();
  if (gCounter != nullptr && ctx->pending > 0 && !out.empty()) {
    const double flops = ctx->pending * spatial(out[0]);
    std::lock_guard<std::mutex> lock(gCounter->mutex);
    (gCounter->inBackward ? gCounter->backward : gCounter->forward) += flops;
  }
}

// Observes the dispatched operators while it lives (one at a time).
class FlopObserver {
 public:
  explicit FlopObserver(Counter& counter) {
    static std::mutex once;
    lock_ = std::unique_lock<std::mutex>(once);
    gCounter = &counter;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(onStart, onEnd)
                                        .needsInputs(true)
                                        .needsOutputs(true)
                                        .scopes({at::RecordScope::FUNCTION}));
  }
  ~FlopObserver() {
    at::removeCallback(handle_);
    gCounter = nullptr;
  }
  FlopObserver(const FlopObserver&) = delete;
  FlopObserver& operator=(const FlopObserver&) = delete;

 private:
  std::unique_lock<std::mutex> lock_;
  at::CallbackHandle handle_ = 0;
};

// Live bytes the allocators report while it is installed on this thread (and the
// threads that inherit its state: autograd's, intra-op workers').
class PeakMemory : public c10::MemoryReportingInfoBase {
 public:
  bool memoryProfilingEnabled() const override { return true; }
  void reportMemoryUsage(void* /*ptr*/, int64_t bytes, size_t /*allocated*/, size_t /*reserved*/,
                         c10::Device device) override {
    if (!device.is_cpu()) {
      return;
    }
    const int64_t now = live_.fetch_add(bytes) + bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void reportOutOfMemory(int64_t, size_t, size_t, c10::Device) override {}
  int64_t peak() const { return peak_.load(); }

 private:
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

std::optional<c10::ScalarType> autocastDtype(AmpMode amp, const c10::Device& device) {
  if (amp == AmpMode::Off) {
    return std::nullopt;
  }
  if (device.is_cpu() || amp == AmpMode::Bf16) {
    return c10::kBFloat16;  // fp16 and bf16 take the same bytes
  }
  return c10::kHalf;
}

// One forward and backward on `batch` samples, under the profile's precision.
void trainingPass(const ForwardFn& forward, const std::vector<int64_t>& sampleShape, int64_t batch,
                  AmpMode amp, const c10::Device& device,
                  const std::function<void()>& betweenForwardAndBackward = {}) {
  std::vector<int64_t> shape{batch};
  shape.insert(shape.end(), sampleShape.begin(), sampleShape.end());
  at::Tensor input = at::randn(shape, at::TensorOptions().device(device));
  at::Tensor loss;
  {
    const auto dtype = autocastDtype(amp, device);
    std::optional<AutocastGuard> guard;
    if (dtype) {
      guard.emplace(device.type(), dtype);
    }
    loss = forward(input).to(at::kFloat).mean();
  }
  if (betweenForwardAndBackward) {
    betweenForwardAndBackward();
  }
  loss.backward();
}

void clearGrads(const std::vector<at::Tensor>& parameters) {
  for (const auto& p : parameters) {
    if (p.grad().defined()) {
      p.mutable_grad() = at::Tensor();
    }
  }
}

void synchronize(const c10::Device& device) {
  if (!device.is_cpu()) {
    c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
  }
}

std::string shapeText(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? "x" : "") << shape[i];
  }
  return out.str();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of a training step (forward, backward, momentum-SGD update) at `batch`.
double timeStep(const ForwardFn& forward, const std::vector<at::Tensor>& parameters,
                std::vector<at::Tensor>& momentum, const ProfileOptions& o, int64_t batch) {
  std::vector<double> seconds;
  for (int i = 0; i < o.calibrationSteps + 2; ++i) {  // two warm-up steps
    synchronize(o.device);
    const auto t0 = std::chrono::steady_clock::now();
    clearGrads(parameters);
    trainingPass(forward, o.sampleShape, batch, o.amp, o.device);
    {
      at::NoGradGuard noGrad;
      for (size_t k = 0; k < parameters.size(); ++k) {
        if (parameters[k].grad().defined()) {
          momentum[k].mul_(0.9).add_(parameters[k].grad());
          parameters[k].add_(momentum[k], -1e-3);
        }
      }
    }
    synchronize(o.device);
    if (i >= 2) {
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return median(seconds);
}

}  // namespace

FlopCount countFlops(const ForwardFn& forward, const at::Tensor& input) {
  Counter counter;
  at::Tensor loss;
  {
    FlopObserver observer(counter);
    loss = forward(input).to(at::kFloat).mean();
    {
      std::lock_guard<std::mutex> lock(counter.mutex);
      counter.inBackward = true;
    }
    loss.backward();
  }
  return {counter.forward, counter.backward};
}

ModelProfile profileModel(const ForwardFn& forward, const std::vector<at::Tensor>& parameters,
                          const ProfileOptions& o) {
  HDDP_CHECK_AS(ConfigError, !o.sampleShape.empty(),
                "profileModel: the input sample's shape is empty (give C x H x W)");
  HDDP_CHECK_AS(ConfigError, o.memoryBatch > 0 && o.calibrationBatch > 1,
                "profileModel: batches must be positive (memory ", o.memoryBatch, ", calibration ",
                o.calibrationBatch, ")");
  bool trainable = false;
  for (const auto& t : parameters) {
    trainable = trainable || t.requires_grad();
  }
  HDDP_CHECK_AS(ConfigError, trainable, "profileModel: none of the ", parameters.size(),
                " parameters of ", o.model.empty() ? "the model" : o.model,
                " requires grad: there is no training step to profile");
  const c10::Device cpu(c10::kCPU);
  ModelProfile p;
  p.amp = o.amp;
  p.model = o.model.empty() ? "model " + shapeText(o.sampleShape) : o.model;
  double sampleElements = 1.0;
  for (int64_t s : o.sampleShape) {
    sampleElements *= static_cast<double>(s);
  }
  p.inputBytesPerSample = o.inputBytesPerSample > 0 ? o.inputBytesPerSample : 4.0 * sampleElements;
  for (const auto& t : parameters) {
    p.parameterBytes += static_cast<double>(t.numel()) * 4.0;
    if (t.requires_grad()) {
      p.gradientShapes.push_back(t.sizes().vec());
    }
  }

  // A warm-up pass (one-time caches), then FLOPs at the smaller memory batch.
  trainingPass(forward, o.sampleShape, o.memoryBatch, o.amp, cpu);
  clearGrads(parameters);
  {
    std::vector<int64_t> shape{o.memoryBatch};
    shape.insert(shape.end(), o.sampleShape.begin(), o.sampleShape.end());
    const FlopCount flops = countFlops(forward, at::randn(shape));
    const double b = static_cast<double>(o.memoryBatch);
    p.forwardFlopsPerSample = flops.forward / b;
    p.trainFlopsPerSample = (flops.forward + flops.backward) / b;
  }

  // The step's peak at two batch sizes; the growth per sample is the activations.
  int64_t peaks[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    clearGrads(parameters);
    auto reporter = std::make_shared<PeakMemory>();
    {
      c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, reporter);
      trainingPass(forward, o.sampleShape, o.memoryBatch * (i + 1), o.amp, cpu);
    }
    peaks[i] = reporter->peak();
  }
  clearGrads(parameters);
  p.activationBytesPerSample =
      std::max(0.0, static_cast<double>(peaks[1] - peaks[0]) / static_cast<double>(o.memoryBatch));

  if (!o.calibrateOn.empty()) {
    auto move = [&](const c10::Device& device) {
      if (o.moveTo) {
        o.moveTo(device);
        return;
      }
      for (const auto& t : parameters) {
        t.set_data(t.data().to(device));
      }
    };
    move(o.device);
    std::vector<at::Tensor> momentum;
    for (const auto& t : parameters) {
      momentum.push_back(at::zeros_like(t));
    }
    const int64_t half = o.calibrationBatch / 2;
    const double small = timeStep(forward, parameters, momentum, o, half);
    const double large = timeStep(forward, parameters, momentum, o, o.calibrationBatch);
    double perSample = (large - small) / static_cast<double>(o.calibrationBatch - half);
    double fixed = small - perSample * static_cast<double>(half);
    if (!(perSample > 0) || fixed < 0) {  // timing noise: no fixed part to go by
      perSample = large / static_cast<double>(o.calibrationBatch);
      fixed = 0.0;
    }
    p.calibratedOn = o.calibrateOn;
    p.calibratedSecondsPerSample = perSample;
    p.calibratedFixedSeconds = fixed;
    clearGrads(parameters);
    move(cpu);
  }
  return p;
}

}  // namespace hddp
