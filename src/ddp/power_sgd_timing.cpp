// timePowerSgdCompute (hddp/ddp/power_sgd.h): what `--compress auto` prices PowerSGD's
// arithmetic with, timed on the rank's own device.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "ddp/power_sgd_math.h"
#include "hddp/core/error.h"
#include "hddp/ddp/power_sgd.h"

namespace hddp {

using detail::orthogonalize;

double timePowerSgdCompute(const std::vector<std::vector<int64_t>>& shapes,
                           const PowerSgdOptions& options, const c10::Device& device) {
  HDDP_CHECK_AS(ConfigError, options.rank >= 1 && options.minCompressionRate > 0,
                "timing PowerSGD needs a rank of at least 1 and a positive minimum compression "
                "rate, got rank ",
                options.rank, " and rate ", options.minCompressionRate);
  const auto type = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto cpu = at::TensorOptions().dtype(at::kFloat);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.randomSeed);
  c10::impl::VirtualGuardImpl guard(device.type());
  auto sync = [&] {
    if (!device.is_cpu()) {
      guard.synchronizeDevice(device.index());
    }
  };
  // One gradient at a time (the device holds one matrix's buffers, not the model's):
  // the fastest of three passes after a warm-up, summed.
  double total = 0.0;
  for (const auto& shape : shapes) {
    if (shape.empty()) {
      continue;  // a scalar goes whole, as in the hook
    }
    int64_t cols = 1;
    for (size_t k = 1; k < shape.size(); ++k) {
      cols *= shape[k];
    }
    const int64_t rows = shape[0];
    const int64_t r = std::min<int64_t>({rows, cols, options.rank});
    if (rows == 0 || cols == 0 ||
        !(static_cast<double>((rows + cols) * r) * options.minCompressionRate <
          static_cast<double>(rows * cols))) {
      continue;
    }
    const at::Tensor m = at::randn({1, rows, cols}, generator, cpu).to(type);
    at::Tensor error = at::zeros({1, rows, cols}, type);
    at::Tensor p = at::empty({1, rows, r}, type);
    at::Tensor q = at::randn({1, cols, r}, generator, cpu).to(type);
    double best = std::numeric_limits<double>::max();
    for (int pass = 0; pass < 4; ++pass) {
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      const at::Tensor input = m + error;  // error feedback in
      orthogonalize(q, options.orthogonalizationEpsilon);
      at::bmm_out(p, input, q);
      orthogonalize(p, options.orthogonalizationEpsilon);
      at::bmm_out(q, input.transpose(1, 2), p);
      at::sub_out(error, input, at::bmm(p, q.transpose(1, 2)));
      sync();
      if (pass > 0) {
        best = std::min(
            best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    total += best;
  }
  return total;
}

}  // namespace hddp
