// Autocast on emu (the AutocastPrivateUse1 dispatch key): the operators CUDA runs in
// float16/bfloat16 under autocast run so on emu too, those CUDA keeps in float32 stay
// there, and every other operator falls through. LibTorch registers these lists for its
// built-in devices only; a PrivateUse1 backend registers its own (ATen's own op lists,
// so emu follows CUDA's policy as LibTorch changes it).
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "emu/runtime.h"

namespace hddp {
namespace emu {
namespace detail {

void registerAutocast(torch::Library& aten, torch::Library& all) {
  all.fallback(torch::CppFunction::makeFallthrough());
  auto& m = aten;  // the KERNEL macros register on `m`
#define HDDP_EMU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define HDDP_EMU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define HDDP_EMU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define HDDP_EMU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(HDDP_EMU_LOWER_PRECISION_FP)
  AT_FORALL_FP32(HDDP_EMU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(HDDP_EMU_FP32_SET_OPT_DTYPE)
  AT_FORALL_PROMOTE(HDDP_EMU_PROMOTE)
#undef HDDP_EMU_LOWER_PRECISION_FP
#undef HDDP_EMU_FP32
#undef HDDP_EMU_FP32_SET_OPT_DTYPE
#undef HDDP_EMU_PROMOTE
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
