// Multi-process tests: initFromEnv over TCP, a killed rank, hddp-run's supervision.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cstdio>

#include "hddp/comm/rendezvous.h"
#include "hddp/core/error.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runProcesses;

int freePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// torchrun's variables for this child, meeting at a free port rank 0 picks, on the CPU
// (on a GPU machine the ranks would otherwise take cuda:<rank>).
void setTorchrunEnvironment(int rank, int size, hddp::Store& store) {
  setenv("HDDP_DEVICE", "cpu", 1);
  if (rank == 0) {
    store.set("port", std::to_string(freePort()));
  }
  const std::string port = store.getString("port");
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
}

TEST(Processes, InitFromEnvTorchrunStyle) {
  auto outcomes = runProcesses(3, [](int rank, int size, hddp::Store& store) {
    setTorchrunEnvironment(rank, size, store);
    auto ctx = hddp::initFromEnv();
    EXPECT_EQ(ctx.rank(), rank);
    EXPECT_EQ(ctx.worldSize(), size);
    EXPECT_EQ(ctx.info.launcher, hddp::Launcher::Torchrun);
    EXPECT_TRUE(ctx.device.is_cpu());
    auto t = torch::full({16}, float(rank));
    ctx.communicator->allreduce(t).wait();
    EXPECT_TRUE(t.equal(torch::full({16}, 3.0f)));
  });
  hddp::testing::expectAllSucceeded(outcomes);
}

// One rank with a wish the job cannot meet (`wish`, a VAR=value for rank 1): every
// rank fails at once with the reason (`why`), none waits for the store's timeout (30
// minutes by default). One runProcesses per test: the children re-run the test.
void expectEveryRankFailsAtOnce(const std::string& wish, const std::string& why) {
  const auto start = std::chrono::steady_clock::now();
  auto outcomes = runProcesses(
      2,
      [&wish](int rank, int size, hddp::Store& store) {
        setTorchrunEnvironment(rank, size, store);
        if (rank == 1) {
          const auto eq = wish.find('=');
          setenv(wish.substr(0, eq).c_str(), wish.substr(eq + 1).c_str(), 1);
        }
        try {
          hddp::initFromEnv();
        } catch (const hddp::ConfigError& e) {
          std::fprintf(stderr, "ConfigError: %s\n", e.what_without_backtrace());
          std::fflush(stderr);
          _exit(3);
        }
      },
      std::chrono::seconds(60));
  ASSERT_EQ(outcomes.size(), 2u);
  for (const auto& o : outcomes) {
    EXPECT_TRUE(o.exited && o.exitCode == 3) << wish << ", rank " << o.rank << ": " << o.output;
    EXPECT_NE(o.output.find(why), std::string::npos) << o.output;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 50.0);
}

TEST(Processes, ABackendOneRankAsksForAloneFailsEveryRankAtOnce) {
  expectEveryRankFailsAtOnce("HDDP_BACKEND=nccl",
                             "rank 0 for auto (the default), rank 1 for nccl (HDDP_BACKEND)");
}

TEST(Processes, ADeviceOneRankLacksFailsEveryRankAtOnce) {
  expectEveryRankFailsAtOnce("HDDP_DEVICE=cuda:9", "is given cuda:9 by HDDP_DEVICE=cuda:9");
}

TEST(Processes, KilledRankMakesTheOthersRaiseWithinTheTimeout) {
  auto outcomes = runProcesses(3, [](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions opts;
    opts.timeout = std::chrono::seconds(10);
    auto comm = hddp::makeCommunicator(store, rank, size, opts);
    auto t = torch::ones({1 << 16});
    comm->allreduce(t).wait();  // everyone is connected and working
    if (rank == 2) {
      raise(SIGKILL);  // dies without a goodbye, as a crashed process would
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      for (int i = 0; i < 1000; ++i) {
        auto u = torch::ones({1 << 16});
        comm->allreduce(u).wait();
      }
      ADD_FAILURE() << "rank " << rank << ": collectives kept succeeding without rank 2";
    } catch (const hddp::DistributedError& e) {
      const std::string msg = e.what_without_backtrace();
      std::fprintf(stderr, "rank %d got the expected error: %s\n", rank, msg.c_str());
      EXPECT_NE(msg.find("allreduce(sum)"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank " + std::to_string(rank) + "/3"), std::string::npos) << msg;
      EXPECT_NE(msg.find("65536 elements"), std::string::npos) << msg;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(25));
  });
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_FALSE(outcomes[2].exited);
  EXPECT_EQ(outcomes[2].signal, SIGKILL);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(outcomes[r].exited && outcomes[r].exitCode == 0) << "rank " << r << " output:\n"
                                                                 << outcomes[r].output;
  }
}

using hddp::testing::runCommand;

std::string launcher() { return hddp::testing::toolsDir() + "/hddp-run"; }
std::string worker() { return HDDP_TEST_WORKER; }

// The ranks get torchrun's variables and know hddp-run launched them; each output line
// carries the rank once: hddp-run's prefix, not a second one from hddp's log lines.
TEST(HddpRun, RunsRanksWithTorchrunEnvironmentAndPrefixedOutput) {
  auto r = runCommand("HDDP_LOG_LEVEL=info " + launcher() + " --nproc-per-node 3 -- " + worker() +
                      " allreduce");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    EXPECT_NE(r.output.find(prefix + "sum=3 restart=0 launcher=hddp-run"), std::string::npos)
        << r.output;
    // "[rank 1] [2026-12-05 22:04:01.123] [hddp.comm] [info] rank 1/3 (local 1/3) from
    // hddp-run, ...", where the rank used to come twice and torchrun was named.
    const size_t at = r.output.find(prefix + "[20");
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    EXPECT_NE(line.find("] [hddp.comm] [info] rank " + std::to_string(rank) + "/3 (local " +
                        std::to_string(rank) + "/3) from hddp-run,"),
              std::string::npos)
        << line;
    EXPECT_EQ(line.find("[rank", prefix.size()), std::string::npos) << "the rank twice: " << line;
  }
  EXPECT_EQ(r.output.find("from torchrun"), std::string::npos) << r.output;
  // --no-prefix: the log lines name the rank themselves.
  auto plain = runCommand("HDDP_LOG_LEVEL=info " + launcher() +
                          " --no-prefix --nproc-per-node 2 -- " + worker() + " allreduce");
  EXPECT_EQ(plain.exitCode, 0) << plain.output;
  EXPECT_NE(plain.output.find("] [rank 1] [hddp.comm] [info] rank 1/2"), std::string::npos)
      << plain.output;
}

// A launcher started under hddp-run (here `env`, setting the TORCHELASTIC_RUN_ID that a
// nested torchrun sets for its workers) inherits hddp-run's variables; its ranks are
// not hddp-run's: they name the launcher torchrun and their rank in their own lines.
TEST(HddpRun, RanksOfALauncherStartedUnderItAreNotItsOwn) {
  auto r = runCommand("HDDP_LOG_LEVEL=info " + launcher() + " --nproc-per-node 2 -- env " +
                      "TORCHELASTIC_RUN_ID=none " + worker() + " allreduce");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    EXPECT_NE(r.output.find(prefix + "sum=2 restart=0 launcher=torchrun"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("] " + prefix + "[hddp.comm] [info] rank " + std::to_string(rank) +
                            "/2 (local " + std::to_string(rank) + "/2) from torchrun,"),
              std::string::npos)
        << r.output;
  }
  EXPECT_EQ(r.output.find("from hddp-run"), std::string::npos) << r.output;
}

TEST(HddpRun, DevicesGiveEachRankItsDeviceAndTheJobOneBackend) {
  auto r = runCommand(launcher() + " --devices cpu,CPU -- " + worker() + " allreduce");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {  // two ranks: the list's length
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) +
                            "] sum=2 restart=0 launcher=hddp-run device=cpu backend=gloo"),
              std::string::npos)
        << r.output;
  }
  // A device this machine lacks (no GPU has nine): the job ends within seconds naming
  // the rank and the device, not after the store's 30-minute timeout.
  auto missing = runCommand(launcher() + " --devices cpu,cuda:9 --grace-period 2 -- " + worker() +
                            " allreduce");
  EXPECT_NE(missing.exitCode, 0) << missing.output;
  EXPECT_NE(missing.output.find("rank 1 (local rank 1) is given cuda:9 by entry 1 of "
                                "HDDP_DEVICE='cpu,cuda:9'"),
            std::string::npos)
      << missing.output;
  EXPECT_LT(missing.seconds, 60.0);
}

TEST(HddpRun, BadDeviceListsAreUsageErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--nproc-per-node 3 --devices cpu,cpu",
       "--devices lists 2 device(s) but --nproc-per-node is 3"},
      {"--devices cuda:0,gpu1", "--devices entry 1 'gpu1' is not a device"},
      {"--devices cuda:0,cpu,cuda:0", "--devices gives cuda:0 to local ranks 0 and 2"},
      {"--devices cuda,cuda:0", "--devices gives cuda:0 to local ranks 0 and 1"},
      {"--nproc-per-node 2 --share-devices", "--share-devices needs --devices"},
  };
  for (const auto& [flags, message] : cases) {
    auto r = runCommand(launcher() + " " + flags + " -- " + worker() + " allreduce");
    EXPECT_EQ(r.exitCode, 2) << flags << ": " << r.output;
    EXPECT_NE(r.output.find("hddp-run: " + message), std::string::npos) << r.output;
  }
}

TEST(HddpRun, FailedRankEndsTheJobAndIsNamed) {
  auto r =
      runCommand(launcher() + " --nproc-per-node 3 --grace-period 2 -- " + worker() + " fail 1 7");
  EXPECT_EQ(r.exitCode, 7) << r.output;
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 7"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60.0) << "the other ranks sleep 10 minutes unless stopped";
}

// Rank 1 dies; rank 0 exits with an error the moment it sees that. The launcher names
// rank 1, the first to fail, not the lowest rank that ended.
TEST(HddpRun, NamesTheFirstRankToFailNotTheLowest) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = runCommand(launcher() + " --nproc-per-node 3 --grace-period 2 -- " + worker() +
                      " cascade " + dir);
  EXPECT_EQ(r.exitCode, 128 + SIGKILL) << r.output;
  EXPECT_NE(r.output.find("hddp-run: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL); stopping the other ranks"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("hddp-run: rank 0 (pid"), std::string::npos) << r.output;
}

// Without --master-addr the other nodes would dial their own loopback and wait for the
// store's timeout (30 minutes).
TEST(HddpRun, SeveralNodesNeedAMasterAddressTheOthersCanReach) {
  for (const std::string addr : {"", " --master-addr 127.0.0.1"}) {
    // (timeout: without the check, node 1 would wait for a store on its own loopback)
    auto r =
        runCommand("timeout 30 " + launcher() + " --nnodes 2 --node-rank 1 --master-port 29517" +
                   addr + " -- " + worker() + " allreduce");
    EXPECT_EQ(r.exitCode, 2) << r.output;
    EXPECT_NE(r.output.find("--master-addr"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("loopback"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 30.0);
  }
}

// A single-node job's store and Gloo listen on loopback only.
TEST(HddpRun, ASingleNodeJobListensOnLoopbackOnly) {
  for (const std::string flags : {" --nproc-per-node 2", " --standalone --nproc-per-node 2"}) {
    auto r = runCommand(launcher() + flags + " -- " + worker() + " listening");
    EXPECT_EQ(r.exitCode, 0) << r.output;
    EXPECT_EQ(r.output.find("EXPOSED"), std::string::npos) << r.output;
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] listen "), std::string::npos)
          << "rank " << rank << " listens nowhere? " << r.output;
    }
  }
}

TEST(HddpRun, RestartsTheGroupWithIncrementedRestartCount) {
  auto r = runCommand(launcher() + " --nproc-per-node 2 --max-restarts 2 --grace-period 2 -- " +
                      worker() + " fail-once 0 3");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("restarting the group"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sum=2 restart=1"), std::string::npos) << r.output;
}

// A store connection that drops while rank 1 joins (HDDP_FAULT drop@store=2, the first
// attempt only): rank 1 fails with a StoreError, hddp-run restarts the group, and the
// second attempt joins and sums.
TEST(HddpRun, ADroppedStoreConnectionAtTheRendezvousIsSurvivedByARestart) {
  auto r = runCommand("HDDP_FAULT='drop@store=2,rank=1' " + launcher() +
                      " --nproc-per-node 2 --max-restarts 1 --grace-period 2 -- " + worker() +
                      " allreduce");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("injecting 'drop@store=2,rank=1' (HDDP_FAULT) at store operation 2"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("the connection to the store dropped"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting the group"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sum=2 restart=1"), std::string::npos) << r.output;
}

TEST(HddpRun, MissingProgramIsAUsageError) {
  auto r = runCommand(launcher() + " --nproc-per-node 2");
  EXPECT_EQ(r.exitCode, 2) << r.output;
  EXPECT_NE(r.output.find("no program given"), std::string::npos) << r.output;
  auto bad = runCommand(launcher() + " --nproc-per-node 1 -- /nonexistent/program");
  EXPECT_EQ(bad.exitCode, 127) << bad.output;
  EXPECT_NE(bad.output.find("cannot execute"), std::string::npos) << bad.output;
}

TEST(HddpRun, CtrlCStopsAllRanks) {
  // SIGINT to hddp-run while the ranks sleep: all stop, exit code 130.
  auto r = runCommand("( " + launcher() + " --nproc-per-node 2 --grace-period 2 -- " + worker() +
                      " fail 5 1 & pid=$!; sleep 3; kill -INT $pid; wait $pid )");
  EXPECT_EQ(r.exitCode, 128 + SIGINT) << r.output;
  EXPECT_NE(r.output.find("received SIGINT"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60.0);
}

}  // namespace
