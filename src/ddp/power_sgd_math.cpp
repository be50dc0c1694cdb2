// PowerSGD's orthogonalisation (power_sgd_math.h): PyTorch's _orthogonalize in C++.
#include "ddp/power_sgd_math.h"

#include <ATen/ATen.h>

namespace hddp {
namespace detail {

namespace {

// PyTorch's _orthogonalize_gram_schmidt: columns of each matrix of a batch (b x n x r)
// made orthonormal in place.
void gramSchmidt(at::Tensor& matrices, double epsilon) {
  const int64_t columns = matrices.size(2);
  for (int64_t i = 0; i < columns; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::linalg_vector_norm(col, 2, at::IntArrayRef{1}, /*keepdim=*/true);
    if (epsilon == 0) {
      // An all-zero column stays zero (PyTorch's would turn NaN: 0/0); any other is
      // divided exactly as PyTorch's.
      col.div_(at::where(norm > 0, norm, at::ones_like(norm)));
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < columns) {
      at::Tensor rest = matrices.narrow(2, i + 1, columns - i - 1);
      rest.sub_(at::sum(col * rest, at::IntArrayRef{1}, /*keepdim=*/true) * col);
    }
  }
}

}  // namespace

void orthogonalize(at::Tensor matrices, double epsilon) {
  const int64_t rank = matrices.size(2);
  const auto type = matrices.scalar_type();
  if (rank <= 2 || type == at::kHalf || type == at::kBFloat16) {
    gramSchmidt(matrices, epsilon);
  } else {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices, "reduced")));
  }
}

}  // namespace detail
}  // namespace hddp
