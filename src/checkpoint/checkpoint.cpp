#include "hddp/checkpoint/checkpoint.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "core/gradient_capture.h"
#include "core/torch_compat.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything the recomputation needs besides the saved inputs.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointFunction fn;
  size_t numInputs = 0;
  std::vector<bool> inputRequiresGrad;
  at::Tensor cpuRngState;
  std::vector<std::pair<at::Device, at::Tensor>> deviceRngStates;
  std::vector<at::Tensor> parameters;
  // Autocast of the forward, per device type: the CPU, CUDA and every device type of
  // the inputs (an XPU's, a PrivateUse1 backend's such as hddp::emu). The recomputation
  // runs in backward, on the autograd engine's device thread, where it must be restored.
  struct Autocast {
    c10::DeviceType type;
    bool enabled;
    c10::ScalarType dtype;
  };
  std::vector<Autocast> autocast;
};

std::vector<CheckpointState::Autocast> currentAutocast(const std::vector<c10::DeviceType>& types) {
  std::vector<CheckpointState::Autocast> out;
  for (const auto type : types) {
    out.push_back({type, compat::autocastEnabled(type), compat::autocastDtype(type)});
  }
  return out;
}

void setAutocast(const std::vector<CheckpointState::Autocast>& states) {
  for (const auto& a : states) {
    compat::setAutocastEnabled(a.type, a.enabled);
    compat::setAutocastDtype(a.type, a.dtype);
  }
}

at::Tensor getRngState(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void setRngState(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Restores the RNG and autocast state of the forward for its lifetime.
class ForwardStateScope {
 public:
  explicit ForwardStateScope(const CheckpointState& s) {
    // Every generator's state is saved before any is set: a device whose generator is
    // the CPU's (an emulated one) would otherwise save the forward's state as its own.
    auto cpu = at::detail::getDefaultCPUGenerator();
    savedCpu_ = getRngState(cpu);
    for (const auto& entry : s.deviceRngStates) {
      auto gen = at::globalContext().defaultGenerator(entry.first);
      if (gen.unsafeGetGeneratorImpl() != cpu.unsafeGetGeneratorImpl()) {
        savedDevices_.emplace_back(entry.first, getRngState(gen));
      }
    }
    setRngState(cpu, s.cpuRngState);
    for (const auto& entry : s.deviceRngStates) {
      auto gen = at::globalContext().defaultGenerator(entry.first);
      if (gen.unsafeGetGeneratorImpl() != cpu.unsafeGetGeneratorImpl()) {
        setRngState(gen, entry.second);
      }
    }
    std::vector<c10::DeviceType> types;
    for (const auto& a : s.autocast) {
      types.push_back(a.type);
    }
    previousAutocast_ = currentAutocast(types);
    setAutocast(s.autocast);
    // An autocast scope, as PyTorch's checkpoint opens one: the recomputation's
    // low-precision weight casts are cached only for this scope. Without it they would
    // outlive the optimizer step and the next forward would use the old weights.
    compat::incrementAutocastNesting();
  }
  ~ForwardStateScope() {
    if (compat::decrementAutocastNesting() == 0) {
      compat::clearAutocastCache();
    }
    auto cpu = at::detail::getDefaultCPUGenerator();
    setRngState(cpu, savedCpu_);
    for (auto& entry : savedDevices_) {
      auto gen = at::globalContext().defaultGenerator(entry.first);
      setRngState(gen, entry.second);
    }
    setAutocast(previousAutocast_);
  }

 private:
  at::Tensor savedCpu_;
  std::vector<std::pair<at::Device, at::Tensor>> savedDevices_;
  std::vector<CheckpointState::Autocast> previousAutocast_;
};

// Leaves requiring grad reachable from `roots` (through AccumulateGrad nodes).
void collectLeaves(const variable_list& roots, std::vector<at::Tensor>& leaves) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& r : roots) {
    if (r.defined() && r.grad_fn()) {
      stack.push_back(r.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) {
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) {
        continue;
      }
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get())) {
        leaves.push_back(acc->variable);
      } else {
        stack.push_back(edge.function.get());
      }
    }
  }
}

struct CheckpointAutograd : public torch::autograd::Function<CheckpointAutograd> {
  // `all` = inputs followed by parameters.
  // `all` must be a TensorList: Function::apply creates graph edges for the elements
  // of an ArrayRef argument, not for those of a std::vector.
  static variable_list forward(AutogradContext* ctx,
                               const c10::intrusive_ptr<CheckpointState>& state,
                               at::TensorList all) {
    variable_list inputs(all.begin(), all.begin() + static_cast<long>(state->numInputs));
    variable_list outputs;
    {
      torch::NoGradGuard noGrad;
      outputs = state->fn(inputs);
    }
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    ctx->saved_data["num_params"] = static_cast<int64_t>(all.size() - state->numInputs);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list gradOutputs) {
    auto state =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const int64_t numParams = ctx->saved_data["num_params"].toInt();
    variable_list saved = ctx->get_saved_variables();
    variable_list detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      detached.push_back(saved[i].detach().requires_grad_(state->inputRequiresGrad[i]));
    }
    variable_list outputs;
    {
      ForwardStateScope scope(*state);
      torch::AutoGradMode grad(true);
      outputs = state->fn(detached);
    }
    variable_list roots;
    variable_list rootGrads;
    for (size_t i = 0; i < outputs.size() && i < gradOutputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && gradOutputs[i].defined()) {
        roots.push_back(outputs[i]);
        rootGrads.push_back(gradOutputs[i]);
      }
    }
    variable_list result(saved.size() + static_cast<size_t>(numParams));
    if (roots.empty()) {
      return prepend(result);
    }
    // Which leaves did the recomputation use? They must be our inputs or the listed
    // parameters; anything else would silently lose its gradient.
    std::vector<at::Tensor> leaves;
    collectLeaves(roots, leaves);
    const auto& params = state->parameters;
    for (const auto& leaf : leaves) {
      bool known = false;
      for (const auto& d : detached) {
        known = known || leaf.is_same(d);
      }
      for (const auto& p : params) {
        known = known || leaf.is_same(p);
      }
      HDDP_CHECK(known, "hddp::checkpoint: the function used a tensor that requires grad (shape ",
                 leaf.sizes(),
                 ") but was neither an input nor in `parameters`; its gradient would be lost. Pass "
                 "it (e.g. "
                 "module->parameters()) as the third argument.");
    }
    variable_list wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].requires_grad()) {
        wrt.push_back(detached[i]);
        slot.push_back(i);
      }
    }
    for (size_t j = 0; j < params.size(); ++j) {
      wrt.push_back(params[j]);
      slot.push_back(saved.size() + j);
    }
    variable_list grads;
    {
      // The parameters' hooks run again when these gradients reach them through the
      // outer backward; transforming hooks skip this capture (see gradient_capture.h).
      detail::GradientCaptureScope capture;
      grads = torch::autograd::grad(roots, wrt, rootGrads, /*retain_graph=*/false,
                                    /*create_graph=*/false,
                                    /*allow_unused=*/true);
    }
    for (size_t k = 0; k < grads.size(); ++k) {
      result[slot[k]] = grads[k];
    }
    return prepend(result);
  }

  // Slot 0 is the state argument (no gradient).
  static variable_list prepend(const variable_list& grads) {
    variable_list out{at::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointFunction& fn,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& parameters) {
  HDDP_CHECK(static_cast<bool>(fn), "hddp::checkpoint: the function is empty");
  bool anyGrad = false;
  for (const auto& t : inputs) {
    HDDP_CHECK(t.defined(), "hddp::checkpoint: an input is undefined");
    anyGrad = anyGrad || t.requires_grad();
  }
  std::vector<at::Tensor> trainable;
  for (const auto& p : parameters) {
    if (p.defined() && p.requires_grad()) {
      trainable.push_back(p);
    }
  }
  if (!torch::GradMode::is_enabled()) {
    return fn(inputs);  // no graph is being recorded: nothing to save
  }
  HDDP_CHECK(
      anyGrad || !trainable.empty(),
      "hddp::checkpoint: no input requires grad and no parameters were given, so the recomputation "
      "could never produce a gradient. Pass the parameters the function uses (e.g. "
      "module->parameters()), or call the function directly.");
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->numInputs = inputs.size();
  state->parameters = trainable;
  for (const auto& t : inputs) {
    state->inputRequiresGrad.push_back(t.requires_grad());
  }
  state->cpuRngState = getRngState(at::detail::getDefaultCPUGenerator());
  // The RNG of every device of the inputs (dropout on a GPU), and the autocast state
  // of the CPU, CUDA and those devices' types.
  std::set<std::pair<int, c10::DeviceIndex>> devices;
  std::vector<c10::DeviceType> types{c10::kCPU, c10::kCUDA};
  for (const auto& t : inputs) {
    if (t.defined() && !t.is_cpu()) {
      const c10::Device d = t.device();
      devices.insert({static_cast<int>(d.type()), d.has_index() ? d.index() : 0});
      if (std::find(types.begin(), types.end(), d.type()) == types.end() &&
          compat::autocastAvailable(d.type())) {
        types.push_back(d.type());
      }
    }
  }
  for (const auto& [type, index] : devices) {
    const at::Device d(static_cast<c10::DeviceType>(type), index);
    state->deviceRngStates.emplace_back(d, getRngState(at::globalContext().defaultGenerator(d)));
  }
  state->autocast = currentAutocast(types);
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), trainable.begin(), trainable.end());
  return CheckpointAutograd::apply(state, at::TensorList(all));
}

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential sequential,
                                                       int segments)
    : sequential_(std::move(sequential)), segments_(segments) {
  HDDP_CHECK(sequential_, "CheckpointedSequential needs a Sequential");
  HDDP_CHECK(segments_ >= 1, "CheckpointedSequential needs at least one segment, got ", segments_);
  reset();
}

void CheckpointedSequentialImpl::reset() { register_module("sequential", sequential_); }

at::Tensor CheckpointedSequentialImpl::runRange(size_t begin, size_t end, const at::Tensor& x) {
  at::Tensor h = x;
  for (size_t i = begin; i < end; ++i) {
    h = (sequential_->begin() + static_cast<std::ptrdiff_t>(i))->forward<at::Tensor>(h);
  }
  return h;
}

at::Tensor CheckpointedSequentialImpl::forward(const at::Tensor& input) {
  const size_t n = sequential_->size();
  if (!is_training() || n == 0) {
    return runRange(0, n, input);
  }
  const size_t k = std::min<size_t>(static_cast<size_t>(segments_), n);
  const size_t per = (n + k - 1) / k;
  at::Tensor h = input;
  for (size_t begin = 0; begin < n; begin += per) {
    const size_t end = std::min(n, begin + per);
    if (end == n) {
      h = runRange(begin, end, h);  // the last segment is not checkpointed
      break;
    }
    std::vector<at::Tensor> params;
    for (size_t i = begin; i < end; ++i) {
      auto p = sequential_->ptr(i)->parameters();
      params.insert(params.end(), p.begin(), p.end());
    }
    bool anyGrad = h.requires_grad();
    for (const auto& p : params) {
      anyGrad = anyGrad || p.requires_grad();
    }
    if (!anyGrad) {
      h = runRange(begin, end, h);
      continue;
    }
    h = checkpoint(
        [this, begin, end](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{runRange(begin, end, in[0])};
        },
        {h}, params)[0];
  }
  return h;
}

}  // namespace hddp
