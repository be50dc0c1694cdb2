// A small program for launcher tests: joins the job from the environment (as a user's
// program would under hddp-run, torchrun, srun or mpirun) and does what argv says.
//   worker allreduce            allreduce a ones tensor, print "sum=<value> restart=<n>"
//   worker fail RANK CODE       rank RANK exits with CODE after joining; the others wait
//   worker fail-once RANK CODE  like fail, but only when TORCHELASTIC_RESTART_COUNT is 0
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "hddp/hddp.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "allreduce";
  try {
    auto ctx = hddp::initFromEnv();
    const int restart = ctx.info.restartCount;
    if (mode == "fail" || mode == "fail-once") {
      const int failRank = std::atoi(argv[2]);
      const int code = std::atoi(argv[3]);
      if (ctx.rank() == failRank && (mode == "fail" || restart == 0)) {
        std::fprintf(stderr, "worker: rank %d failing on purpose with %d\n", failRank, code);
        return code;
      }
      if (mode == "fail" || restart == 0) {
        std::this_thread::sleep_for(std::chrono::minutes(10));  // hddp-run must stop us
        return 0;
      }
    }
    at::Tensor t = at::ones({4});
    ctx.communicator->allreduce(t).wait();
    std::printf("sum=%g restart=%d launcher=%s\n", t[0].item<double>(), restart,
                hddp::launcherName(ctx.info.launcher));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker failed: %s\n", e.what());
    return 1;
  }
}
