// hddp uses LibTorch's own Gloo (compiled into libtorch_cpu) and never maps a second
// copy of Gloo: see third_party/gloo_decls/README.md and docs/architecture.md.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "support/ranks.h"

namespace {

TEST(BackendIdentity, GlooComesFromLibtorchAndNoLibglooIsMapped) {
  hddp::testing::runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    ASSERT_EQ(comm->backend(), hddp::Backend::Gloo);
  });
  // The ProcessGroupGloo constructor hddp calls resolves into libtorch_cpu.
  void* sym = dlsym(RTLD_DEFAULT, "_ZN4c10d16ProcessGroupGloo19createDefaultDeviceEb");
  ASSERT_NE(sym, nullptr) << "c10d::ProcessGroupGloo::createDefaultDevice not found";
  Dl_info info{};
  ASSERT_NE(dladdr(sym, &info), 0);
  EXPECT_NE(std::string(info.dli_fname).find("libtorch_cpu"), std::string::npos) << info.dli_fname;
  // No separate Gloo library in the process.
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    EXPECT_EQ(line.find("libgloo"), std::string::npos) << line;
  }
}

TEST(BackendIdentity, NcclAvailabilityMatchesTheBuild) {
  auto store = hddp::Store::memory();
  hddp::CommunicatorOptions opts;
  opts.backend = hddp::Backend::Nccl;
  opts.device = c10::Device(c10::kCPU);
  // On CPU, NCCL is refused with a clear error whether or not it is compiled in.
  EXPECT_THROW(hddp::makeCommunicator(store, 0, 1, opts), hddp::Error);
}

}  // namespace
