// Launcher conventions -> LaunchInfo, and every error case naming its variable.
#include <gtest/gtest.h>

#include "hddp/comm/rendezvous.h"
#include "hddp/core/error.h"

namespace {

using hddp::detectLaunch;
using hddp::EnvMap;
using hddp::InitOptions;
using hddp::Launcher;

std::string errorOf(const InitOptions& opts, const EnvMap& env) {
  try {
    detectLaunch(opts, env);
  } catch (const hddp::ConfigError& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(Launch, NothingSetIsASingleProcess) {
  auto info = detectLaunch({}, {});
  EXPECT_EQ(info.launcher, Launcher::Single);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.worldSize, 1);
}

TEST(Launch, Torchrun) {
  EnvMap env = {{"RANK", "5"},
                {"WORLD_SIZE", "8"},
                {"LOCAL_RANK", "1"},
                {"LOCAL_WORLD_SIZE", "4"},
                {"MASTER_ADDR", "node0"},
                {"MASTER_PORT", "29400"},
                {"TORCHELASTIC_RESTART_COUNT", "2"},
                {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  auto info = detectLaunch({}, env);
  EXPECT_EQ(info.launcher, Launcher::Torchrun);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.worldSize, 8);
  EXPECT_EQ(info.localRank, 1);
  EXPECT_EQ(info.localWorldSize, 4);
  EXPECT_EQ(info.masterAddr, "node0");
  EXPECT_EQ(info.masterPort, 29400);
  EXPECT_EQ(info.restartCount, 2);
  EXPECT_TRUE(info.useAgentStore);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  EXPECT_FALSE(detectLaunch({}, env).useAgentStore);
}

TEST(Launch, Slurm) {
  EnvMap env = {{"SLURM_PROCID", "3"},
                {"SLURM_NTASKS", "4"},
                {"SLURM_LOCALID", "1"},
                {"SLURM_NTASKS_PER_NODE", "2(x2)"},
                {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                {"SLURM_JOB_ID", "123456"}};
  auto info = detectLaunch({}, env);
  EXPECT_EQ(info.launcher, Launcher::Slurm);
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.worldSize, 4);
  EXPECT_EQ(info.localRank, 1);
  EXPECT_EQ(info.localWorldSize, 2);
  EXPECT_EQ(info.masterAddr, "gpu07");
  EXPECT_EQ(info.masterPort, 20000 + 123456 % 10000);
  env["SLURM_LAUNCH_NODE_IPADDR"] = "10.0.0.5";
  EXPECT_EQ(detectLaunch({}, env).masterAddr, "10.0.0.5");
  env["MASTER_ADDR"] = "explicit-host";
  env["MASTER_PORT"] = "1234";
  EXPECT_EQ(detectLaunch({}, env).masterAddr, "explicit-host");
  EXPECT_EQ(detectLaunch({}, env).masterPort, 1234);
}

// A 23-digit count used to escape as std::out_of_range from std::stoi.
TEST(Launch, OverlongSlurmCountIsAConfigErrorNamingTheVariable) {
  EnvMap env = {{"SLURM_PROCID", "0"},
                {"SLURM_NTASKS", "2"},
                {"SLURM_NTASKS_PER_NODE", "99999999999999999999999"},
                {"SLURM_JOB_NODELIST", "gpu07"}};
  try {
    detectLaunch({}, env);
    FAIL() << "expected a ConfigError";
  } catch (const hddp::ConfigError& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find("SLURM_NTASKS_PER_NODE"), std::string::npos) << m;
  }
}

TEST(Launch, SlurmNodelists) {
  EXPECT_EQ(hddp::firstSlurmHost("gpu[01-04,07],login1"), "gpu01");
  EXPECT_EQ(hddp::firstSlurmHost("nodeA,nodeB"), "nodeA");
  EXPECT_EQ(hddp::firstSlurmHost("single"), "single");
  EXPECT_EQ(hddp::firstSlurmHost("rack1-n[3,5]"), "rack1-n3");
}

TEST(Launch, OpenMpi) {
  EnvMap env = {{"OMPI_COMM_WORLD_RANK", "2"},
                {"OMPI_COMM_WORLD_SIZE", "3"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                {"MASTER_ADDR", "head"},
                {"MASTER_PORT", "29999"}};
  auto info = detectLaunch({}, env);
  EXPECT_EQ(info.launcher, Launcher::OpenMpi);
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.worldSize, 3);
  EXPECT_EQ(info.localRank, 0);
  EXPECT_EQ(info.localWorldSize, 1);
  env.erase("MASTER_ADDR");
  const std::string msg = errorOf({}, env);
  EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mpirun -x"), std::string::npos) << msg;
}

TEST(Launch, PrecedenceExplicitThenTorchrunThenSlurmThenMpi) {
  EnvMap env = {{"RANK", "1"},
                {"WORLD_SIZE", "2"},
                {"MASTER_ADDR", "a"},
                {"MASTER_PORT", "1000"},
                {"SLURM_PROCID", "0"},
                {"SLURM_NTASKS", "4"},
                {"OMPI_COMM_WORLD_RANK", "3"},
                {"OMPI_COMM_WORLD_SIZE", "4"}};
  EXPECT_EQ(detectLaunch({}, env).launcher, Launcher::Torchrun);
  EXPECT_EQ(detectLaunch({}, env).rank, 1);
  env.erase("RANK");
  env.erase("WORLD_SIZE");
  EXPECT_EQ(detectLaunch({}, env).launcher, Launcher::Slurm);
  env.erase("SLURM_PROCID");
  EXPECT_EQ(detectLaunch({}, env).launcher, Launcher::OpenMpi);
  InitOptions opts;
  opts.rank = 0;
  opts.worldSize = 2;
  opts.masterPort = 4242;
  auto info = detectLaunch(opts, env);
  EXPECT_EQ(info.launcher, Launcher::Explicit);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.worldSize, 2);
  EXPECT_EQ(info.masterPort, 4242);
}

TEST(Launch, ErrorsNameTheVariable) {
  EXPECT_NE(
      errorOf({}, {{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}})
          .find("RANK=4 is not below WORLD_SIZE=4"),
      std::string::npos);
  EXPECT_NE(errorOf({}, {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}})
                .find("MASTER_ADDR is not set"),
            std::string::npos);
  EXPECT_NE(
      errorOf({}, {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}).find("MASTER_PORT"),
      std::string::npos);
  EXPECT_NE(errorOf({}, {{"RANK", "0"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(errorOf({}, {{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x' is not an integer"),
            std::string::npos);
  EXPECT_NE(errorOf({}, {{"RANK", "0"}, {"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0"),
            std::string::npos);
  EXPECT_NE(errorOf({}, {{"RANK", "0"},
                         {"WORLD_SIZE", "2"},
                         {"LOCAL_RANK", "2"},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"MASTER_ADDR", "a"},
                         {"MASTER_PORT", "1"}})
                .find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(
      errorOf({},
              {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}})
          .find("MASTER_PORT=70000 is not a TCP port"),
      std::string::npos);
}

TEST(Launch, DeviceChoice) {
  hddp::LaunchInfo info;
  info.localRank = 1;
  EXPECT_EQ(hddp::chooseDevice(info, 0), c10::Device(c10::kCPU));
  EXPECT_EQ(hddp::chooseDevice(info, 2), c10::Device(c10::kCUDA, 1));
  EXPECT_THROW(hddp::chooseDevice(info, 1), hddp::ConfigError);
  EXPECT_EQ(hddp::chooseDevice(info, 1, /*allowShared=*/true), c10::Device(c10::kCUDA, 0));
}

TEST(Launch, DuplicateGpuDetected) {
  EXPECT_NO_THROW(
      hddp::checkDistinctDevices({"h1|cuda:0", "h1|cuda:1", "h2|cuda:0", "h1|cpu", "h1|cpu"}));
  try {
    hddp::checkDistinctDevices({"h1|cuda:0", "h1|cuda:1", "h1|cuda:0"});
    FAIL() << "expected a ConfigError";
  } catch (const hddp::ConfigError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("duplicate GPU detected: ranks 0 and 2 both use cuda:0 on host 'h1'"),
              std::string::npos)
        << msg;
  }
}

}  // namespace
