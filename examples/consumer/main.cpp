// Built against an installed hddp through find_package(hddp): joins a (single-rank)
// job from the environment and allreduces a tensor.
#include <ATen/ATen.h>
#include <hddp/hddp.h>

#include <cstdio>

int main() {
  auto ctx = hddp::initFromEnv();
  at::Tensor t = at::full({8}, 2.0);
  ctx.communicator->allreduce(t, {hddp::ReduceOp::Sum}).wait();
  const double expected = 2.0 * ctx.worldSize();
  const bool ok = t.eq(expected).all().item<bool>();
  std::printf("hddp %s consumer: rank %d/%d, allreduce %s\n", hddp::version(), ctx.rank(),
              ctx.worldSize(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
