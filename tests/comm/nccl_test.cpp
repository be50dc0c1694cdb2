// NCCL communicator on a real GPU (world size 1 on a single-GPU machine), several
// ranks sharing one GPU through Gloo's staging path, a GPU rank with a CPU rank in
// one job, and how a collective that cannot complete ends (the rules on CPU, c10d's
// watchdog and blocking wait on a GPU). The *_CUDA tests skip without CUDA.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdlib>
#include <map>
#include <mutex>

#include "comm/nccl_failure_handling.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/rendezvous.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"
#include "support/scoped_env.h"

namespace {

#define SKIP_WITHOUT_CUDA()                                                                \
  if (!torch::cuda::is_available() || !hddp::ncclAvailable()) {                            \
    GTEST_SKIP() << "needs a CUDA device and the NCCL build (run tools/gpu-check.sh on a " \
                    "GPU machine)";                                                        \
  }

TEST(Nccl, AllreduceBroadcastAllgatherOnOneGpu_CUDA) {
  SKIP_WITHOUT_CUDA();
  auto store = hddp::Store::memory();
  hddp::CommunicatorOptions opts;
  opts.backend = hddp::Backend::Nccl;
  opts.device = c10::Device(c10::kCUDA, 0);
  auto comm = hddp::makeCommunicator(store, 0, 1, opts);
  auto t = torch::arange(1 << 20, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat));
  auto expected = t.clone();
  comm->allreduce(t, {hddp::ReduceOp::Avg}).wait();
  EXPECT_TRUE(t.equal(expected));
  std::vector<torch::Tensor> many = {t.clone(), torch::ones({3}, t.options())};
  comm->allreduceCoalesced(many).wait();
  EXPECT_TRUE(many[1].equal(torch::ones({3}, t.options())));
  comm->broadcast(t, 0).wait();
  std::vector<torch::Tensor> outs = {torch::empty_like(t)};
  comm->allgather(outs, t).wait();
  EXPECT_TRUE(outs[0].equal(t));
  auto bytes = comm->allgatherBytes({1, 2, 3});
  EXPECT_EQ(bytes[0], (std::vector<uint8_t>{1, 2, 3}));
  comm->barrier().wait();
}

TEST(Nccl, GlooStagesCudaTensorsForRanksSharingOneGpu_CUDA) {
  SKIP_WITHOUT_CUDA();
  hddp::testing::runThreads(2, [](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto t = torch::full({1000}, float(rank + 1), torch::kCUDA);
    comm->allreduce(t).wait();
    EXPECT_TRUE(t.cpu().equal(torch::full({1000}, 3.0f)));
    comm->broadcast(t, 1).wait();
  });
}

// A GPU rank and a CPU rank (hddp-run --devices cuda:0,cpu): the job agrees on Gloo,
// the GPU rank's CUDA tensors go through host memory, and a weighted DDP step over an
// uneven split [3, 5] gives both ranks the gradient of one device on all 8 samples.
TEST(Nccl, GlooServesAGpuRankAndACpuRankInOneJob_CUDA) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  auto reference = torch::nn::Linear(6, 2);
  const auto x = torch::randn({8, 6});
  const auto y = torch::randn({8, 2});
  torch::mse_loss(reference->forward(x), y).backward();
  const auto want = reference->weight.grad().clone();
  std::vector<at::Tensor> grads(2);
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    const c10::Device device = rank == 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    hddp::RankDeviceClaim mine;
    mine.host = "h";
    mine.device = device.str();
    mine.ncclAvailable = true;
    const auto claims =
        hddp::exchangeDeviceClaims(store, rank, size, mine, "mixed", std::chrono::seconds(60));
    const auto agreed = hddp::agreeOnBackend(claims);
    ASSERT_EQ(agreed.backend, hddp::Backend::Gloo) << agreed.reason;
    hddp::CommunicatorOptions opts;
    opts.backend = agreed.backend;
    opts.device = device;
    auto comm = hddp::makeCommunicator(store, rank, size, opts);
    auto t = torch::full({1000}, float(rank + 1), torch::TensorOptions().device(device));
    comm->allreduce(t).wait();
    EXPECT_TRUE(t.cpu().equal(torch::full({1000}, 3.0f)));
    auto b = rank == 0 ? torch::arange(16, torch::TensorOptions().device(device)).to(at::kFloat)
                       : torch::zeros({16});
    comm->broadcast(b, 0).wait();
    EXPECT_TRUE(b.cpu().equal(torch::arange(16).to(at::kFloat)));

    auto model = torch::nn::Linear(6, 2);
    {
      torch::NoGradGuard g;
      model->weight.copy_(reference->weight);
      model->bias.copy_(reference->bias);
    }
    model->to(device);
    hddp::DistributedDataParallel ddp(model, *comm);
    const int64_t start = rank == 0 ? 0 : 3;
    const int64_t n = rank == 0 ? 3 : 5;
    ddp.setBatch(n, 8);
    torch::mse_loss(model->forward(x.narrow(0, start, n).to(device)),
                    y.narrow(0, start, n).to(device))
        .backward();
    ddp.finalize();
    grads[rank] = model->weight.grad().cpu();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(grads[r].defined());
    EXPECT_LT((grads[r] - want).abs().max().item<double>(), 1e-5) << "rank " << r;
  }
}

// ---------------------------------------------------------------------------------
// A collective that cannot complete (issue #36: a lost peer must end the rank, so that
// torchrun's agent restarts the job). c10d's ProcessGroupNCCL ends it, by the rules in
// comm/nccl_failure_handling.h, checked here on CPU; the *_CUDA tests below check them
// against torch's own watchdog and blocking wait on a GPU.

using hddp::detail::NcclFailureEnd;
using hddp::detail::NcclFailureHandling;
using Environment = std::map<std::string, std::string>;
using std::chrono::milliseconds;
using std::chrono::seconds;

NcclFailureHandling handlingUnder(const Environment& env, milliseconds timeout = seconds(600)) {
  return hddp::detail::ncclFailureHandling(
      hddp::detail::readNcclFailureSettings(
          [&env](const std::string& name) -> std::optional<std::string> {
            const auto it = env.find(name);
            return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
          }),
      timeout);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(NcclFailure, TorchDefaultsEndTheProcessWithinTheTimeoutAndFourDumpWaits) {
  const auto h = handlingUnder({});
  EXPECT_EQ(h.end, NcclFailureEnd::ProcessEnds);
  // 10 min timeout + 4 x 15 s dump wait + one 100 ms watchdog period
  EXPECT_EQ(h.bound, seconds(600) + seconds(60) + milliseconds(100));
  EXPECT_TRUE(contains(h.description, "TORCH_NCCL_ASYNC_ERROR_HANDLING=3")) << h.description;
  EXPECT_TRUE(contains(h.description, "SIGABRT")) << h.description;

  const auto shortDump =
      handlingUnder({{"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "250"}}, seconds(2));
  EXPECT_EQ(shortDump.end, NcclFailureEnd::ProcessEnds);
  EXPECT_EQ(shortDump.bound, milliseconds(2000 + 1000 + 100));
}

TEST(NcclFailure, EveryTearDownModeEndsTheProcessAndModeOneAbortsFirst) {
  for (const std::string mode : {"1", "3", "-1", "7"}) {  // c10d: tear down unless 0 or 2
    const auto h = handlingUnder({{"TORCH_NCCL_ASYNC_ERROR_HANDLING", mode}});
    EXPECT_EQ(h.end, NcclFailureEnd::ProcessEnds) << mode;
    EXPECT_EQ(contains(h.description, "aborts the communicators"), mode != "3") << h.description;
  }
}

TEST(NcclFailure, NoHandlingAndAbortOnlyNeverEndTheRankAndTheMessageNamesTheFix) {
  for (const std::string mode : {"0", "2"}) {
    const auto h = handlingUnder({{"TORCH_NCCL_ASYNC_ERROR_HANDLING", mode}});
    EXPECT_EQ(h.end, NcclFailureEnd::Nothing) << mode;
    EXPECT_EQ(h.bound, milliseconds(0)) << mode;
    EXPECT_TRUE(contains(h.description, "TORCH_NCCL_ASYNC_ERROR_HANDLING=" + mode))
        << h.description;
    EXPECT_TRUE(contains(h.description, "never exits")) << h.description;
    EXPECT_TRUE(contains(h.description, "Unset it")) << h.description;
    EXPECT_TRUE(contains(h.description, "TORCH_NCCL_BLOCKING_WAIT=1")) << h.description;
  }
  EXPECT_TRUE(contains(handlingUnder({{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}}).description,
                       "hangs for ever"));
}

TEST(NcclFailure, BlockingWaitRaisesFromWaitWithinTheTimeoutWhateverTheMode) {
  for (const std::string on : {"1", "true", "YES", "t"}) {
    const auto h = handlingUnder(
        {{"TORCH_NCCL_BLOCKING_WAIT", on}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}}, seconds(30));
    EXPECT_EQ(h.end, NcclFailureEnd::WaitRaises) << on;
    EXPECT_EQ(h.bound, seconds(30)) << on;  // no watchdog, so no dump wait
  }
  for (const std::string off : {"0", "false", "No"}) {
    EXPECT_EQ(handlingUnder({{"TORCH_NCCL_BLOCKING_WAIT", off}}).end, NcclFailureEnd::ProcessEnds)
        << off;
  }
}

TEST(NcclFailure, DesyncDebugTurnsNoHandlingIntoAnEndButNotAbortOnly) {
  const auto h =
      handlingUnder({{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}, {"TORCH_NCCL_DESYNC_DEBUG", "1"}});
  EXPECT_EQ(h.end, NcclFailureEnd::ProcessEnds);
  EXPECT_TRUE(contains(h.description, "3 under TORCH_NCCL_DESYNC_DEBUG")) << h.description;
  EXPECT_EQ(
      handlingUnder({{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"}, {"TORCH_NCCL_DESYNC_DEBUG", "1"}})
          .end,
      NcclFailureEnd::Nothing);
}

TEST(NcclFailure, TorchNamesWinOverTheOlderNcclNames) {
  const auto legacy = handlingUnder({{"NCCL_ASYNC_ERROR_HANDLING", "0"}});
  EXPECT_EQ(legacy.end, NcclFailureEnd::Nothing);
  // the message names the variable the user set, so that "Unset it" can be followed
  EXPECT_EQ(legacy.description.rfind("NCCL_ASYNC_ERROR_HANDLING=0", 0), 0u) << legacy.description;
  EXPECT_EQ(
      handlingUnder({{"NCCL_ASYNC_ERROR_HANDLING", "0"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}})
          .end,
      NcclFailureEnd::ProcessEnds);
  EXPECT_EQ(handlingUnder({{"NCCL_BLOCKING_WAIT", "1"}}).end, NcclFailureEnd::WaitRaises);
  EXPECT_EQ(handlingUnder({{"NCCL_BLOCKING_WAIT", "1"}, {"TORCH_NCCL_BLOCKING_WAIT", "0"}}).end,
            NcclFailureEnd::ProcessEnds);
}

TEST(NcclFailure, ValuesTorchWouldRefuseAreConfigErrorsNamingTheVariable) {
  const std::vector<Environment> refused = {{{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "three"}},
                                            {{"TORCH_NCCL_BLOCKING_WAIT", "maybe"}},
                                            {{"NCCL_DESYNC_DEBUG", "2"}},
                                            {{"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "soon"}}};
  for (const auto& env : refused) {
    const auto& [name, value] = *env.begin();
    try {
      handlingUnder(env);
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const hddp::ConfigError& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_TRUE(contains(msg, name + "='" + value + "'")) << msg;
    }
  }
}

using hddp::testing::ScopedEnv;

// The warnings logged while an NCCL communicator for cuda:0 is created from the process's
// environment. Without a GPU, c10d refuses to create it after hddp has read the settings.
std::vector<std::string> warningsCreatingAnNcclCommunicator() {
  std::mutex mutex;
  std::vector<std::string> warnings;
  hddp::log::setLineHandler([&](hddp::log::Level level, const std::string& line) {
    if (level >= hddp::log::Level::Warn) {
      std::lock_guard<std::mutex> lock(mutex);
      warnings.push_back(line);
    }
  });
  try {
    auto store = hddp::Store::memory();
    hddp::CommunicatorOptions opts;
    opts.backend = hddp::Backend::Nccl;
    opts.device = c10::Device(c10::kCUDA, 0);
    opts.timeout = seconds(5);
    hddp::makeCommunicator(store, 0, 1, opts);
  } catch (const hddp::Error&) {
    // no GPU here: ProcessGroupNCCL's constructor refused
  }
  hddp::log::setLineHandler(nullptr);
  return warnings;
}

TEST(NcclFailure, CreatingACommunicatorWarnsWhenALostPeerWouldHangTheRank) {
  if (!hddp::ncclAvailable()) {
    GTEST_SKIP() << "this build has no NCCL backend (a Torch without CUDA)";
  }
  ScopedEnv legacy("NCCL_ASYNC_ERROR_HANDLING", nullptr);
  ScopedEnv blocking("TORCH_NCCL_BLOCKING_WAIT", nullptr);
  ScopedEnv desync("TORCH_NCCL_DESYNC_DEBUG", nullptr);
  {
    ScopedEnv mode("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0");
    const auto warnings = warningsCreatingAnNcclCommunicator();
    ASSERT_FALSE(warnings.empty());
    EXPECT_TRUE(contains(warnings[0], "rank 0/1")) << warnings[0];
    EXPECT_TRUE(contains(warnings[0], "never ended")) << warnings[0];
    EXPECT_TRUE(contains(warnings[0], "TORCH_NCCL_ASYNC_ERROR_HANDLING=0")) << warnings[0];
  }
  ScopedEnv mode("TORCH_NCCL_ASYNC_ERROR_HANDLING", nullptr);
  for (const auto& line : warningsCreatingAnNcclCommunicator()) {
    EXPECT_FALSE(contains(line, "never ended")) << line;
  }
}

TEST(NcclFailure, CreatingACommunicatorRefusesAValueTorchWouldRefuse) {
  if (!hddp::ncclAvailable()) {
    GTEST_SKIP() << "this build has no NCCL backend (a Torch without CUDA)";
  }
  ScopedEnv bad("TORCH_NCCL_BLOCKING_WAIT", "maybe");
  auto store = hddp::Store::memory();
  hddp::CommunicatorOptions opts;
  opts.backend = hddp::Backend::Nccl;
  opts.device = c10::Device(c10::kCUDA, 0);
  try {
    hddp::makeCommunicator(store, 0, 1, opts);
    ADD_FAILURE() << "TORCH_NCCL_BLOCKING_WAIT=maybe was accepted";
  } catch (const hddp::ConfigError& e) {  // before c10d's own check (or its missing GPU)
    EXPECT_TRUE(contains(e.what_without_backtrace(), "TORCH_NCCL_BLOCKING_WAIT='maybe'"))
        << e.what_without_backtrace();
  }
}

// A collective that cannot complete, on one GPU: a kernel that spins for minutes sits
// ahead of it on the stream that NCCL's stream waits for. To c10d this is what a lost
// peer looks like when NCCL reports nothing: a Work not completed past the timeout.
// (NCCL's own error for a dead peer, and two ranks, need a second GPU: NCCL refuses two
// ranks on one device.) at::cuda::sleep lives in libtorch_cuda; it is looked up at run
// time so that this file also builds against a Torch without CUDA.
void launchAStuckAllreduce(hddp::Communicator& comm, at::Tensor& t, int64_t spinCycles) {
  using Sleep = void (*)(int64_t);
  const auto spin = reinterpret_cast<Sleep>(dlsym(RTLD_DEFAULT, "_ZN2at4cuda5sleepEl"));
  ASSERT_NE(spin, nullptr) << "at::cuda::sleep not found in the loaded LibTorch";
  comm.allreduce(t).wait();  // creates NCCL's communicator: its set-up is not timed
  torch::cuda::synchronize();
  spin(spinCycles);
  comm.allreduce(t).wait();  // NCCL's wait() returns at once: it only orders the stream
}

std::unique_ptr<hddp::Communicator> ncclOnGpu0(hddp::Store& store, int rank, int size,
                                               milliseconds timeout) {
  hddp::CommunicatorOptions opts;
  opts.backend = hddp::Backend::Nccl;
  opts.device = c10::Device(c10::kCUDA, 0);
  opts.timeout = timeout;
  return hddp::makeCommunicator(store, rank, size, opts);
}

// torch's defaults (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): c10d's watchdog ends the process
// on SIGABRT within the timeout (2 s) + 4 x the dump wait (250 ms here, 15 s by
// default), while the host waits for the result, as a training step would.
TEST(Nccl, AStuckCollectiveEndsTheProcessWithinTheTimeoutAndTheDumpWait_CUDA) {
  SKIP_WITHOUT_CUDA();
  const auto start = std::chrono::steady_clock::now();
  const auto outcomes = hddp::testing::runProcesses(
      1,
      [](int rank, int size, hddp::Store& store) {
        for (const char* name : {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
                                 "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"}) {
          unsetenv(name);
        }
        setenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "250", 1);
        auto comm = ncclOnGpu0(store, rank, size, seconds(2));
        auto t = torch::ones({1024}, torch::kCUDA);
        launchAStuckAllreduce(*comm, t, int64_t{1} << 38);  // over two minutes at 2 GHz
        std::fprintf(stderr, "stuck allreduce launched\n");
        comm->synchronize();  // blocks until the watchdog ends the process
        ADD_FAILURE() << "the stuck allreduce completed: the spinning kernel ended first";
      },
      seconds(60));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(outcomes.size(), 1u);
  const auto& o = outcomes[0];
  EXPECT_TRUE(contains(o.output, "stuck allreduce launched")) << o.output;
  EXPECT_FALSE(o.exited) << "exit code " << o.exitCode << ", output:\n" << o.output;
  EXPECT_EQ(o.signal, SIGABRT) << o.output;
  EXPECT_TRUE(contains(o.output, "Watchdog caught collective operation timeout")) << o.output;
  // start-up and NCCL's set-up + 2 s + 1 s; the spinning kernel alone takes minutes
  EXPECT_LT(took, 45.0) << o.output;
}

// TORCH_NCCL_BLOCKING_WAIT=1: no watchdog; wait() blocks the host, aborts the
// communicator and raises hddp::TimeoutError naming the collective and the rank.
TEST(Nccl, UnderBlockingWaitAStuckCollectiveRaisesATimeoutErrorFromWait_CUDA) {
  SKIP_WITHOUT_CUDA();
  const auto outcomes = hddp::testing::runProcesses(
      1,
      [](int rank, int size, hddp::Store& store) {
        setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 1);
        auto comm = ncclOnGpu0(store, rank, size, seconds(2));
        auto t = torch::ones({1024}, torch::kCUDA);
        const auto launched = std::chrono::steady_clock::now();
        try {
          // ~3.4e10 cycles, 17 s at 2 GHz: wait() must raise, not return once it ends
          launchAStuckAllreduce(*comm, t, int64_t{1} << 35);
          ADD_FAILURE() << "wait() returned on a collective that cannot complete";
        } catch (const hddp::TimeoutError& e) {
          const std::string msg = e.what_without_backtrace();
          std::fprintf(
              stderr, "wait() raised after %.1f s: %s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - launched).count(),
              msg.c_str());
          EXPECT_TRUE(contains(msg, "allreduce(sum)")) << msg;
          EXPECT_TRUE(contains(msg, "rank 0/1")) << msg;
        }
        // 2 s, unless aborting the communicator waits for the spinning kernel (it is not
        // NCCL's, so the abort does not stop it; a lost peer's NCCL kernel it does stop)
        EXPECT_LT(std::chrono::steady_clock::now() - launched, seconds(40));
        // Leave now: tearing down would wait for the spinning kernel.
        std::fflush(stderr);
        std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      seconds(60));
  ASSERT_EQ(outcomes.size(), 1u);
  const auto& o = outcomes[0];
  EXPECT_TRUE(o.exited && o.exitCode == 0) << "signal " << o.signal << ", output:\n" << o.output;
  EXPECT_TRUE(contains(o.output, "wait() raised")) << o.output;
}

}  // namespace
