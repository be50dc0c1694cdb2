// Launcher conventions -> LaunchInfo, each rank's device, the job's backend, and every
// error case naming its variable, rank or device.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>

#include "hddp/comm/devices.h"
#include "hddp/comm/rendezvous.h"
#include "hddp/core/error.h"
#include "support/ranks.h"

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

// hddp-run uses torchrun's variables but says it launched the rank, and whether it
// prefixes the rank's stderr lines (so hddp's log lines leave the rank out); torchrun
// itself sets neither.
TEST(Launch, HddpRunIsNamedAsItselfAndSaysWhetherItPrefixesTheRank) {
  EnvMap env = {{"RANK", "1"},
                {"WORLD_SIZE", "2"},
                {"MASTER_ADDR", "127.0.0.1"},
                {"MASTER_PORT", "29400"},
                {"TORCHELASTIC_RUN_ID", "hddp-4242"}};
  auto torchrun = detectLaunch({}, env);
  EXPECT_EQ(torchrun.launcher, Launcher::Torchrun);
  EXPECT_FALSE(torchrun.rankPrefixed);
  env["HDDP_LAUNCHER"] = "hddp-run";
  env["HDDP_LAUNCHER_RUN_ID"] = "hddp-4242";  // the TORCHELASTIC_RUN_ID hddp-run set
  env["HDDP_RANK_PREFIXED"] = "1";
  auto hddpRun = detectLaunch({}, env);
  EXPECT_EQ(hddpRun.launcher, Launcher::HddpRun);
  EXPECT_STREQ(hddp::launcherName(hddpRun.launcher), "hddp-run");
  EXPECT_EQ(hddpRun.rank, 1);
  EXPECT_TRUE(hddpRun.rankPrefixed);
  env["HDDP_RANK_PREFIXED"] = "0";  // --no-prefix, or rank 0's terminal
  EXPECT_FALSE(detectLaunch({}, env).rankPrefixed);
}

// `hddp-run -- script.sh` where the script runs torchrun: torchrun's workers inherit
// hddp-run's variables, but torchrun sets its own TORCHELASTIC_RUN_ID ("none" without
// --rdzv-id). They are torchrun's ranks, and nobody prefixes their lines with their
// rank (hddp-run tags all of them with the script's). Without a run id, or a stamp, the
// variables do not count either.
TEST(Launch, HddpRunsVariablesUnderANestedTorchrunAreTorchruns) {
  EnvMap env = {{"RANK", "3"},
                {"WORLD_SIZE", "4"},
                {"MASTER_ADDR", "127.0.0.1"},
                {"MASTER_PORT", "29400"},
                {"HDDP_LAUNCHER", "hddp-run"},
                {"HDDP_LAUNCHER_RUN_ID", "hddp-4242"},
                {"HDDP_RANK_PREFIXED", "1"},
                {"TORCHELASTIC_RUN_ID", "none"}};
  for (const char* runId : {"none", "job-7", ""}) {
    env["TORCHELASTIC_RUN_ID"] = runId;
    const auto nested = detectLaunch({}, env);
    EXPECT_EQ(nested.launcher, Launcher::Torchrun) << runId;
    EXPECT_EQ(nested.rank, 3);
    EXPECT_FALSE(nested.rankPrefixed) << runId;
    EXPECT_FALSE(hddp::detectJob(env).rankPrefixed) << runId;
  }
  env.erase("TORCHELASTIC_RUN_ID");
  EXPECT_EQ(detectLaunch({}, env).launcher, Launcher::Torchrun);
  EXPECT_FALSE(detectLaunch({}, env).rankPrefixed);
  env["TORCHELASTIC_RUN_ID"] = "hddp-4242";  // hddp-run's own rank
  EXPECT_EQ(detectLaunch({}, env).launcher, Launcher::HddpRun);
  EXPECT_TRUE(detectLaunch({}, env).rankPrefixed);
  EXPECT_TRUE(hddp::detectJob(env).rankPrefixed);
  env.erase("HDDP_LAUNCHER_RUN_ID");  // an hddp-run from before the stamp, or a hand-set one
  EXPECT_EQ(detectLaunch({}, env).launcher, Launcher::Torchrun);
  EXPECT_FALSE(detectLaunch({}, env).rankPrefixed);
}

// What the Trainer takes from the launch information instead of reading the
// environment itself: the restart count of any launcher (torchrun's variable, which
// hddp-run sets, else a requeued Slurm job's), and an elastic job's slot and folder.
TEST(Launch, RestartCountSlotAndElasticJobWhateverTheLauncher) {
  EXPECT_EQ(detectLaunch({}, {}).jobRestarts, 0);
  EXPECT_FALSE(detectLaunch({}, {}).elastic);
  EXPECT_EQ(detectLaunch({}, {{"TORCHELASTIC_RESTART_COUNT", "3"}}).jobRestarts, 3);
  EnvMap slurm = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_RESTART_COUNT", "2"}};
  EXPECT_EQ(detectLaunch({}, slurm).jobRestarts, 2);
  slurm["TORCHELASTIC_RESTART_COUNT"] = "0";  // not positive: Slurm's count decides
  EXPECT_EQ(detectLaunch({}, slurm).jobRestarts, 2);
  // torchrun's first attempt inside a requeued Slurm job: the job was restarted, but the
  // rendezvous of this attempt is torchrun's attempt 0 (keyed by restartCount).
  const auto torchrun = detectLaunch({}, {{"RANK", "0"},
                                          {"WORLD_SIZE", "1"},
                                          {"TORCHELASTIC_RESTART_COUNT", "0"},
                                          {"SLURM_RESTART_COUNT", "2"}});
  EXPECT_EQ(torchrun.restartCount, 0);
  EXPECT_EQ(torchrun.jobRestarts, 2);
  const EnvMap elasticEnv = {
      {"HDDP_ELASTIC", "1"}, {"HDDP_SLOT", "4"}, {"HDDP_ELASTIC_DIR", "/tmp/job"}};
  for (const auto& elastic : {detectLaunch({}, elasticEnv), hddp::detectJob(elasticEnv)}) {
    EXPECT_TRUE(elastic.elastic);
    EXPECT_EQ(elastic.slot, 4);
    EXPECT_EQ(elastic.elasticDir, "/tmp/job");
  }
  // detectJob never fails on who the rank is: a RANK without WORLD_SIZE is
  // detectLaunch's error, not the Trainer's.
  const EnvMap partial = {{"RANK", "1"}, {"TORCHELASTIC_RESTART_COUNT", "1"}};
  EXPECT_THROW(detectLaunch({}, partial), hddp::ConfigError);
  EXPECT_EQ(hddp::detectJob(partial).jobRestarts, 1);
  EXPECT_THROW(detectLaunch({}, {{"TORCHELASTIC_RESTART_COUNT", "x"}}), hddp::ConfigError);
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

// The message of the ConfigError `fn` throws, or "no error".
std::string configErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const hddp::ConfigError& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST(Devices, NamesAndListsAreParsedAndBadEntriesNamed) {
  EXPECT_EQ(hddp::parseDeviceName(" CPU ", "--device"), c10::Device(c10::kCPU));
  EXPECT_EQ(hddp::parseDeviceName("cuda:3", "--device"), c10::Device(c10::kCUDA, 3));
  EXPECT_FALSE(hddp::parseDeviceName("cuda", "--device").has_index());
  const auto list = hddp::parseDeviceList("cuda,cpu,cuda, cuda:5", "--devices");
  EXPECT_EQ(list,
            (std::vector<c10::Device>{c10::Device(c10::kCUDA, 0), c10::Device(c10::kCPU),
                                      c10::Device(c10::kCUDA, 1), c10::Device(c10::kCUDA, 5)}));
  for (const char* bad : {"gpu0", "cuda:", "cuda:-1", "cuda:x", "mps", "", "cuda:123456"}) {
    EXPECT_HAS(configErrorOf([&] { hddp::parseDeviceName(bad, "--device"); }),
               std::string("--device: '") + bad + "' is not a device; use cpu, cuda or cuda:N");
  }
  EXPECT_HAS(configErrorOf([] { hddp::parseDeviceList("cuda:0,,cpu", "HDDP_DEVICE"); }),
             "HDDP_DEVICE entry 1 of 'cuda:0,,cpu': '' is not a device");
}

TEST(Devices, EachRankTakesItsEntryOfHddpDeviceAndMissingDevicesAreNamed) {
  hddp::LaunchInfo info;
  info.rank = 3;
  info.localRank = 1;
  info.localWorldSize = 2;
  const EnvMap mixed{{"HDDP_DEVICE", "cuda:0,cpu"}};
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, mixed, 1), c10::Device(c10::kCPU));
  info.localRank = 0;
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, mixed, 1), c10::Device(c10::kCUDA, 0));
  // One device for every rank; a bare cuda is cuda:<local rank>.
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, {{"HDDP_DEVICE", "cpu"}}, 2),
            c10::Device(c10::kCPU));
  info.localRank = 1;
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, {{"HDDP_DEVICE", "cuda"}}, 2),
            c10::Device(c10::kCUDA, 1));
  // The explicit device (the trainers' --device) wins over HDDP_DEVICE.
  EXPECT_EQ(hddp::resolveDevice(info, c10::Device(c10::kCPU), mixed, 1), c10::Device(c10::kCPU));
  // Without HDDP_DEVICE: cuda:<local rank>, as before.
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, {}, 2), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(hddp::resolveDevice(info, std::nullopt, {}, 0), c10::Device(c10::kCPU));

  // Errors name the rank, the device and where it came from.
  info.localRank = 0;
  EXPECT_HAS(configErrorOf([&] { hddp::resolveDevice(info, std::nullopt, mixed, 0); }),
             "rank 3 (local rank 0) is given cuda:0 by entry 0 of HDDP_DEVICE='cuda:0,cpu' but "
             "no CUDA device is visible");
  EXPECT_HAS(
      configErrorOf([&] {
        hddp::resolveDevice(info, std::nullopt, {{"HDDP_DEVICE", "cuda:2"}}, 2);
      }),
      "is given cuda:2 by HDDP_DEVICE=cuda:2 but 2 CUDA device(s) are visible (cuda:0..cuda:1)");
  EXPECT_HAS(configErrorOf([&] { hddp::resolveDevice(info, c10::Device(c10::kCUDA, 1), {}, 1); }),
             "is given cuda:1 by --device (InitOptions::device) but 1 CUDA device(s) are visible "
             "(cuda:0)");
  EXPECT_HAS(configErrorOf([&] {
               hddp::resolveDevice(info, std::nullopt, {{"HDDP_DEVICE", "cuda:0,cpu,cpu"}}, 1);
             }),
             "HDDP_DEVICE='cuda:0,cpu,cpu' lists 3 devices but this node runs 2 local rank(s)");
}

hddp::RankDeviceClaim claim(const std::string& device, const std::string& requested = "auto",
                            const std::string& host = "h1") {
  hddp::RankDeviceClaim c;
  c.host = host;
  c.device = device;
  c.ncclAvailable = true;
  c.requested = requested;
  c.requestedFrom = requested == "auto" ? "" : "HDDP_BACKEND";
  return c;
}

TEST(Backend, TheJobAgreesOnNcclOnlyWhenEveryRankIsOnItsOwnGpu) {
  using hddp::agreeOnBackend;
  using hddp::Backend;
  EXPECT_EQ(
      agreeOnBackend({claim("cuda:0"), claim("cuda:1"), claim("cuda:0", "auto", "h2")}).backend,
      Backend::Nccl);
  const auto mixed = agreeOnBackend({claim("cuda:0"), claim("cpu")});
  EXPECT_EQ(mixed.backend, Backend::Gloo);
  EXPECT_HAS(mixed.reason, "rank 1 is on cpu");
  EXPECT_EQ(agreeOnBackend({claim("cpu"), claim("cpu")}).reason, "every rank is on the CPU");
  auto noNccl = claim("cuda:1");
  noNccl.ncclAvailable = false;
  EXPECT_HAS(agreeOnBackend({claim("cuda:0"), noNccl}).reason, "rank 1's LibTorch has no NCCL");
  // A shared GPU (every rank allows it) goes through Gloo; not allowed, it is an error.
  auto a = claim("cuda:0");
  auto b = claim("cuda:0");
  a.allowShared = b.allowShared = true;
  const auto shared = agreeOnBackend({a, b});
  EXPECT_EQ(shared.backend, Backend::Gloo);
  EXPECT_HAS(shared.reason, "ranks 0 and 1 share cuda:0 on host 'h1'");
  b.allowShared = false;
  EXPECT_HAS(configErrorOf([&] {
               agreeOnBackend({a, b});
             }),
             "duplicate GPU detected: ranks 0 and 1");
  // An explicit backend: honoured when it can serve the job, else an error.
  EXPECT_EQ(agreeOnBackend({claim("cuda:0", "gloo"), claim("cuda:1", "gloo")}).backend,
            Backend::Gloo);
  EXPECT_EQ(agreeOnBackend({claim("cuda:0", "nccl"), claim("cuda:1", "nccl")}).backend,
            Backend::Nccl);
  EXPECT_HAS(configErrorOf([] {
               agreeOnBackend({claim("cuda:0", "nccl"), claim("cpu", "nccl")});
             }),
             "backend nccl (HDDP_BACKEND) cannot serve this job: rank 1 is on cpu");
  EXPECT_HAS(configErrorOf([] {
               agreeOnBackend({claim("cuda:0"), claim("cuda:1", "nccl")});
             }),
             "the ranks ask for different backends: rank 0 for auto (the default), rank 1 for "
             "nccl (HDDP_BACKEND)");
  // A rank that could not resolve its device takes every rank down with its reason.
  auto broken = claim("cpu");
  broken.error = "rank 1 (local rank 1) is given cuda:3 | by --device";
  const auto decoded = hddp::RankDeviceClaim::decode(broken.encode());
  EXPECT_EQ(decoded.error, "rank 1 (local rank 1) is given cuda:3 / by --device");
  EXPECT_HAS(configErrorOf([&] {
               agreeOnBackend({claim("cpu"), decoded});
             }),
             "rank 1 cannot join the job: rank 1 (local rank 1) is given cuda:3");
}

// Every rank reads all claims through the store and reaches the same backend, or the
// same error, without waiting for a timeout.
TEST(Backend, EveryRankReachesTheSameAnswerThroughTheStore) {
  std::vector<hddp::Backend> backends(3, hddp::Backend::Nccl);
  std::atomic<int> errors{0};
  hddp::testing::runThreads(3, [&](int rank, int size, hddp::Store& store) {
    const std::vector<std::string> devices = {"cuda:0", "cpu", "cuda:1"};
    auto claims = hddp::exchangeDeviceClaims(store, rank, size, claim(devices[rank]), "0",
                                             std::chrono::seconds(30));
    backends[rank] = hddp::agreeOnBackend(claims).backend;
    // Round 1: rank 2 alone asks for NCCL, which the CPU rank rules out anyway.
    claims = hddp::exchangeDeviceClaims(store, rank, size,
                                        claim(devices[rank], rank == 2 ? "nccl" : "auto"), "1",
                                        std::chrono::seconds(30));
    if (configErrorOf([&] { hddp::agreeOnBackend(claims); }).find("rank 2 for nccl") !=
        std::string::npos) {
      ++errors;
    }
  });
  EXPECT_EQ(backends, std::vector<hddp::Backend>(3, hddp::Backend::Gloo));
  EXPECT_EQ(errors.load(), 3);
}

}  // namespace
