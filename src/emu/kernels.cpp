// The operators emu implements itself: memory (empty, resize, set_), views, copies (the
// only operators that may be queued on a side stream), item() and convolution, whose
// device-generic path ends in convolution_overrideable, which no CPU kernel serves.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>

#include "emu/allocator.h"
#include "emu/guard.h"
#include "emu/ordering.h"
#include "emu/runtime.h"
#include "emu/streams.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

constexpr c10::DispatchKeySet kEmuKeys(c10::DispatchKey::PrivateUse1);

void checkEmpty(c10::Device device, std::optional<c10::Layout> layout, std::optional<bool> pin) {
  TORCH_CHECK(device.is_privateuseone(), "hddp::emu: expected an emu device, got ", device);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "hddp::emu: only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin), "hddp::emu: only CPU memory can be pinned");
}

at::Tensor emptyMemoryFormat(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                             std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                             std::optional<bool> pin, std::optional<c10::MemoryFormat> format) {
  const c10::Device d = c10::device_or_default(device);
  checkEmpty(d, layout, pin);
  const c10::DeviceGuard guard(d);
  return at::detail::empty_generic(size, deviceAllocator(), kEmuKeys, c10::dtype_or_default(dtype),
                                   format);
}

at::Tensor emptyStrided(c10::IntArrayRef size, c10::IntArrayRef stride,
                        std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                        std::optional<c10::Device> device, std::optional<bool> pin) {
  const c10::Device d = c10::device_or_default(device);
  checkEmpty(d, layout, pin);
  const c10::DeviceGuard guard(d);
  return at::detail::empty_strided_generic(size, stride, deviceAllocator(), kEmuKeys,
                                           c10::dtype_or_default(dtype));
}

// A CPU tensor over the same memory (emu memory is host memory).
at::Tensor hostView(const at::Tensor& t) {
  if (t.is_cpu()) {
    return t;
  }
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

void copyNow(const at::Tensor& src, const at::Tensor& dst) {
  at::Tensor target = hostView(dst);
  target.copy_(hostView(src));
}

bool isPinnedTensor(const at::Tensor& t) {
  return t.is_cpu() && t.has_storage() && isPinned(t.storage().data());
}

at::Tensor copyFrom(const at::Tensor& self, const at::Tensor& dst, bool nonBlocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "hddp::emu: copy_ of an undefined tensor");
  if (self.numel() == 0 || dst.numel() == 0) {
    return dst;
  }
  const c10::Device device = dst.is_privateuseone() ? dst.device() : self.device();
  const c10::Stream stream = currentStreamOf(device.index());
  const bool crossDevice =
      self.is_privateuseone() && dst.is_privateuseone() && self.device() != dst.device();
  if (crossDevice) {
    // As CUDA's copy between devices: the copy waits for the source device's current
    // stream, and that stream waits for the copy.
    const c10::Stream sourceStream = currentStreamOf(self.device().index());
    if (sourceStream.id() != 0) {
      worker(sourceStream).drain();
    }
    streamWaits(stream, snapshot(sourceStream));
  }
  issue(stream, {{&self, false}, {&dst, true}}, "copy_");
  if (crossDevice) {
    streamWaits(currentStreamOf(self.device().index()), snapshot(stream));
  }
  // A blocking copy, or one into pageable host memory, synchronises the stream, as on CUDA
  // (not the copies inside an operator, which are the operator's own business).
  const bool synchronizes =
      !insideHostOperator() && (!nonBlocking || (dst.is_cpu() && !isPinnedTensor(dst)));
  if (stream.id() == 0 || insideHostOperator()) {
    runOnHost(device, [&] { copyNow(self, dst); });
    if (synchronizes) {
      hostSyncStream(stream);
    }
    return dst;
  }
  // A side stream: the copy runs later on the stream's thread. Pageable host memory is
  // staged now, as CUDA does; pinned memory is read when the copy runs.
  const at::Tensor src = (self.is_cpu() && !isPinnedTensor(self)) ? self.clone() : self;
  worker(stream).enqueue([src, dst, device] { runTimed(device, [&] { copyNow(src, dst); }); });
  if (synchronizes) {
    synchronizeStreamOnHost(stream);
  }
  return dst;
}

at::Tensor copyFromAndResize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copyFrom(self, dst, false);
}

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef size,
                         std::optional<c10::MemoryFormat> format) {
  // A growing tensor gets new memory from the allocator, which takes the current device:
  // make it the tensor's, as CUDA's resize_ does. Without it an out= result of a rank on
  // emu:1 whose thread's current device is emu:0 moved to emu:0.
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), format);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor asStrided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                     std::optional<c10::SymInt> offset) {
  std::optional<int64_t> o;
  if (offset) {
    o = offset->expect_int();
  }
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), o);
}

at::Tensor reshapeAlias(const at::Tensor& self, c10::SymIntArrayRef size,
                        c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

at::Tensor& setTensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& setStorage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& setStorageOffset(at::Tensor& self, at::Storage source, c10::SymInt offset,
                             c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset.expect_int(),
                                      C10_AS_INTARRAYREF_SLOW(size),
                                      C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& setEmpty(at::Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  at::Storage storage(at::Storage::use_byte_size_t(), 0, deviceAllocator(), true);
  return at::native::set_storage_cpu_(self, std::move(storage), 0, {0}, {});
}

// item(): the host reads device memory, which synchronises the current stream (as CUDA).
at::Scalar localScalarDense(const at::Tensor& self) {
  const c10::Stream stream = currentStreamOf(self.device().index());
  issue(stream, {{&self, false}}, "item()");
  synchronizeStreamOnHost(stream);
  at::Scalar value;
  runOnHost(self.device(), [&] { value = hostView(self).item(); });
  return value;
}

// Tensor.record_stream(s): the block may be freed while `stream` still uses it.
void recordTensorStream(at::Tensor& self, c10::Stream stream) {
  if (self.has_storage()) {
    recordStream(self.storage().data_ptr().get(), stream);
  }
}

// Module::to() and set_data() ask whether a CPU tensor may take an emu tensor's data: both
// are dense strided tensors, as CPU and CUDA are.
bool hasCompatibleShallowCopyType(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.is_privateuseone()) && !t.is_quantized();
  };
  if (dense(self) && dense(from)) {
    return true;
  }
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

at::Tensor onHost(const at::Tensor& t) { return t.defined() ? t.cpu() : t; }

// The emu device a convolution runs on; its tensors must all lie there, as on CUDA.
c10::Device convolutionDevice(const char* op, const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& other, const char* otherName) {
  const c10::Device device = input.is_privateuseone() ? input.device() : weight.device();
  checkOnDevice(device, input, op, "input");
  checkOnDevice(device, weight, op, "weight");
  checkOnDevice(device, other, op, otherName);
  return device;
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                       c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool transposed,
                       c10::SymIntArrayRef outputPadding, c10::SymInt groups) {
  const c10::Device device = convolutionDevice("aten::convolution_overrideable", input, weight,
                                               bias.value_or(at::Tensor()), "bias");
  at::Tensor out;
  runOnHost(device, [&] {
    std::optional<at::Tensor> hostBias;
    if (bias && bias->defined()) {
      hostBias = bias->cpu();
    }
    out = at::convolution_symint(onHost(input), onHost(weight), hostBias, stride, padding, dilation,
                                 transposed, outputPadding, groups)
              .to(device);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolutionBackward(
    const at::Tensor& gradOutput, const at::Tensor& input, const at::Tensor& weight,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool transposed, c10::SymIntArrayRef outputPadding, c10::SymInt groups,
    std::array<bool, 3> mask) {
  const c10::Device device = convolutionDevice("aten::convolution_backward_overrideable", input,
                                               weight, gradOutput, "grad_output");
  std::tuple<at::Tensor, at::Tensor, at::Tensor> grads;
  runOnHost(device, [&] {
    std::optional<std::vector<c10::SymInt>> biasSizes;
    if (mask[2]) {
      biasSizes =
          std::vector<c10::SymInt>{transposed ? weight.sym_size(1) * groups : weight.sym_size(0)};
    }
    auto [gi, gw, gb] = at::convolution_backward_symint(
        onHost(gradOutput), onHost(input), onHost(weight),
        biasSizes ? at::OptionalSymIntArrayRef(*biasSizes) : at::OptionalSymIntArrayRef(), stride,
        padding, dilation, transposed, outputPadding, groups, mask);
    grads = {gi.defined() ? gi.to(device) : gi, gw.defined() ? gw.to(device) : gw,
             gb.defined() ? gb.to(device) : gb};
  });
  return grads;
}

}  // namespace

void registerKernels(torch::Library& m) {
  m.impl("empty.memory_format", TORCH_FN(emptyMemoryFormat));
  m.impl("empty_strided", TORCH_FN(emptyStrided));
  m.impl("_copy_from", TORCH_FN(copyFrom));
  m.impl("_copy_from_and_resize", TORCH_FN(copyFromAndResize));
  m.impl("resize_", TORCH_FN(resize));
  m.impl("view", TORCH_FN(view));
  m.impl("as_strided", TORCH_FN(asStrided));
  m.impl("_reshape_alias", TORCH_FN(reshapeAlias));
  m.impl("unfold", TORCH_FN(unfold));
  m.impl("set_.source_Tensor", TORCH_FN(setTensor));
  m.impl("set_.source_Storage", TORCH_FN(setStorage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(setStorageOffset));
  m.impl("set_", TORCH_FN(setEmpty));
  m.impl("_local_scalar_dense", TORCH_FN(localScalarDense));
  m.impl("record_stream", TORCH_FN(recordTensorStream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(hasCompatibleShallowCopyType));
  m.impl("convolution_overrideable", TORCH_FN(convolution));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolutionBackward));
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
