// PowerSGD's orthogonalisation (PyTorch's _orthogonalize), shared by the hook
// (power_sgd.cpp) and the timing that prices it (power_sgd_timing.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace hddp {
namespace detail {

// The columns of each matrix of a batch (b x n x r) made orthonormal in place:
// Gram-Schmidt for a rank up to 2 or half types, else QR (PyTorch's choice).
void orthogonalize(at::Tensor matrices, double epsilon);

}  // namespace detail
}  // namespace hddp
