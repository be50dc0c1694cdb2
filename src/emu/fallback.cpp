// Every other operator: ATen's boxed CPU fallback computes it on CPU copies of the emu
// inputs and copies the results back. Its copies go through emu's _copy_from, so the
// stream-safety checks see every read and write.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUFallback.h>

#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "emu/guard.h"
#include "emu/runtime.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

// Index tensors may stay on the host for these operators, as on CUDA.
bool takesHostIndices(const c10::OperatorHandle& op) {
  static const std::set<std::string> names = {"aten::index",         "aten::index_put",
                                              "aten::index_put_",    "aten::_index_put_impl_",
                                              "aten::_unsafe_index", "aten::_unsafe_index_put"};
  return names.count(op.schema().name()) > 0;
}

// The device an operator runs on: that of its emu tensor arguments, which must agree. A CPU
// tensor argument is refused, as CUDA refuses it, unless it is a scalar (0-dim) or an index
// tensor of index/index_put_; the CPU fallback alone would happily compute either mix.
c10::Device operatorDevice(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& arguments = op.schema().arguments();
  const bool hostIndices = takesHostIndices(op);
  const std::string name = c10::toString(op.schema().operator_name());
  std::optional<c10::Device> found;
  at::Tensor host;  // the first CPU tensor argument that CUDA would refuse, and its name
  std::string hostArgument;
  auto see = [&](const at::Tensor& t, const c10::Argument& argument) {
    if (!t.defined()) {
      return;
    }
    if (t.is_privateuseone()) {
      if (found) {
        checkOnDevice(*found, t, name, argument.name());
      }
      found = t.device();
      return;
    }
    const bool index = hostIndices && argument.name() == "indices" &&
                       at::isIntegralType(t.scalar_type(), /*includeBool=*/true);
    if (t.dim() > 0 && !index && !host.defined()) {
      host = t;
      hostArgument = argument.name();
    }
  };
  const size_t first = stack.size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      see(v.toTensor(), arguments[i]);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        see(t, arguments[i]);
      }
    } else if (v.isOptionalTensorList()) {
      for (const auto& t : v.toOptionalTensorList().vec()) {
        if (t) {
          see(*t, arguments[i]);
        }
      }
    }
  }
  if (found) {
    checkOnDevice(*found, host, name, hostArgument);
    return *found;
  }
  for (size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isDevice() && stack[i].toDevice().is_privateuseone() &&
        stack[i].toDevice().has_index()) {
      return stack[i].toDevice();
    }
  }
  return {c10::DeviceType::PrivateUse1, currentDeviceIndex()};
}

// Arguments an operator writes in place that cpu_fallback does not copy back: optional
// mutable tensors (Tensor(a!)?), and native_batch_norm's running statistics, which it
// updates without an alias annotation.
bool writtenWithoutCopyBack(const c10::OperatorHandle& op, const c10::Argument& argument) {
  if (op.schema().name() == "aten::native_batch_norm") {
    return argument.name() == "running_mean" || argument.name() == "running_var";
  }
  return argument.alias_info() != nullptr && argument.alias_info()->isWrite() &&
         argument.type()->kind() == c10::TypeKind::OptionalType;
}

void emuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::Device device = operatorDevice(op, *stack);
  runOnHost(device, [&] {
    // Such arguments go to cpu_fallback as CPU copies, written back to the device after.
    std::vector<std::pair<at::Tensor, at::Tensor>> writeBack;
    const auto& arguments = op.schema().arguments();
    const size_t first = stack->size() - arguments.size();
    for (size_t i = 0; i < arguments.size(); ++i) {
      c10::IValue& v = (*stack)[first + i];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_privateuseone() &&
          writtenWithoutCopyBack(op, arguments[i])) {
        at::Tensor onDevice = v.toTensor();
        at::Tensor onHost = onDevice.cpu();
        writeBack.emplace_back(onDevice, onHost);
        v = onHost;
      }
    }
    at::native::cpu_fallback(op, stack);
    for (auto& [onDevice, onHost] : writeBack) {
      onDevice.copy_(onHost);
    }
    // cpu_fallback puts new outputs on the device of the first tensor argument, which may be
    // a CPU scalar (torch::where(cpuBool, e, e)); on CUDA they lie on the operator's device.
    const auto& returns = op.schema().returns();
    for (size_t i = 0; i < returns.size(); ++i) {
      c10::IValue& v = (*stack)[stack->size() - returns.size() + i];
      if (returns[i].alias_info() == nullptr && v.isTensor() && v.toTensor().is_cpu()) {
        v = v.toTensor().to(device);
      }
    }
  });
}

}  // namespace

void checkOnDevice(c10::Device device, const at::Tensor& t, const std::string& op,
                   const std::string& argument) {
  TORCH_CHECK(!t.defined() || t.device() == device,
              "Expected all tensors to be on the same device, but found at least two devices, ",
              device, " and ", t.device(), "! (argument '", argument, "' of ", op,
              "). Move it there with .to(", device, ") before the call, as on CUDA.");
}

void registerFallback(torch::Library& m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&emuFallback>());
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
