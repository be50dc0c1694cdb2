// Commit folders that not every rank shares (src/train/commit_folders.h), the round of a
// generation on a store that outlives generations (src/comm/round.h), and the Trainer's
// resume under torchrun's agent (a generation finds its job's commits by the job's id).
#include "train/commit_folders.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "comm/round.h"
#include "hddp/hddp.h"
#include "support/ranks.h"
#include "support/scoped_env.h"

namespace fs = std::filesystem;
using hddp::testing::runThreads;

namespace {

// The trainer of these tests: a small MLP, 40 samples of 4 features, batch 8 (5 steps per
// epoch), SGD with momentum; the rank's parameters after fit() go to `params`.
// `configure` changes the options last. A collective that waits a minute fails the test
// (a rank that runs other exchanges than the rest) rather than hang it.
hddp::TrainSummary train(int rank, int size, hddp::Store& store, const std::string& saveDir,
                         int64_t maxSteps, const hddp::LaunchInfo* launch,
                         std::vector<at::Tensor>* params = nullptr,
                         const std::function<void(hddp::TrainerOptions&)>& configure = nullptr) {
  hddp::CommunicatorOptions c;
  c.timeout = std::chrono::seconds(60);
  auto comm = hddp::makeCommunicator(store, rank, size, c);
  // One initial model in every run: the ranks are threads of one process, whose global
  // generator they would otherwise draw from in turns.
  static std::mutex initialising;
  std::unique_lock<std::mutex> lock(initialising);
  torch::manual_seed(3);
  torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(4, 8), torch::nn::Tanh(),
                            torch::nn::Linear(8, 3));
  lock.unlock();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  hddp::TrainerOptions o;
  o.globalBatch = 8;
  o.epochs = 4;
  o.maxSteps = maxSteps;
  o.balance = false;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 0;
  o.saveDir = saveDir;
  o.saveEvery = 3;
  if (launch) {
    o.launch = *launch;
  }
  if (configure) {
    configure(o);
  }
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(40, 1, 2, 3, /*seed=*/5);
  hddp::Trainer trainer(
      *comm, net.ptr(), [net](const torch::Tensor& x) mutable { return net->forward(x); },
      hddp::crossEntropy(), opt, ds, o);
  // A constant rate: runs that stop at different maxSteps train alike up to there.
  trainer.setSchedule([](const hddp::StepInfo&, torch::optim::Optimizer& optimizer) {
    hddp::setLearningRate(optimizer, 0.1);
  });
  auto summary = trainer.fit();
  if (params) {
    for (const auto& p : net->parameters()) {
      params->push_back(p.detach().clone());
    }
  }
  return summary;
}

// Flips one byte of a state file's payload.
void damage(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(200);
  const char c = static_cast<char>(f.get());
  f.seekp(200);
  f.put(static_cast<char>(~c));
}

void expectSameParameters(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::allclose(a[i], b[i], 1e-5, 1e-6))
        << "tensor " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
  }
}

}  // namespace

TEST(CommitFolders, RanksFindWhoSharesAFolder) {
  const std::string shared = hddp::testing::makeTempDir();
  const std::string own = hddp::testing::makeTempDir();
  std::vector<std::vector<int>> writers(3);
  runThreads(3, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    // Ranks 0 and 2 share a folder, rank 1 has its own (one not made yet).
    const std::string dir = rank == 1 ? own + "/sub" : shared;
    writers[static_cast<size_t>(rank)] = hddp::train::folderGroups(*comm, dir).writer;
  });
  for (const auto& w : writers) {
    EXPECT_EQ(w, (std::vector<int>{0, 1, 0}));
  }
  EXPECT_TRUE(fs::is_directory(own + "/sub"));
  // The tokens are gone.
  for (const auto& dir : {shared, own + "/sub"}) {
    for (const auto& e : fs::directory_iterator(dir)) {
      ADD_FAILURE() << "left behind: " << e.path();
    }
  }
}

// Two ranks with folders of their own: each writes its copy of every commit; a folder
// emptied (a node that comes back with a new disk) receives the newest commit at the
// resume, checked and kept; the run ends where one with a shared folder ends.
TEST(CommitFolders, AFolderWithoutTheNewestCommitReceivesItAtTheResume) {
  const std::string root = hddp::testing::makeTempDir();
  const std::string a = root + "/a", b = root + "/b", shared = root + "/shared";
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, rank == 0 ? a : b, /*maxSteps=*/7, nullptr);
  });
  for (const auto& dir : {a, b}) {
    EXPECT_TRUE(fs::exists(hddp::stateFileName(dir, 6))) << dir;
    EXPECT_TRUE(fs::exists(hddp::stateFileName(dir, 7))) << dir;
  }
  // Node b comes back with an empty folder; node a's newest is step 7.
  for (const auto& e : fs::directory_iterator(b)) {
    fs::remove(e.path());  // (fs::remove_all resolves to libtorch's copy, which crashes)
  }
  hddp::LaunchInfo restarted;
  restarted.jobRestarts = 1;
  std::vector<std::vector<at::Tensor>> resumed(2);
  std::vector<hddp::TrainSummary> summaries(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] =
        train(rank, size, store, rank == 0 ? a : b, /*maxSteps=*/9, &restarted,
              &resumed[static_cast<size_t>(rank)]);
  });
  for (const auto& s : summaries) {
    EXPECT_EQ(s.steps, 2) << "every rank resumed at step 7";
  }
  // b kept the commit it received, and wrote its copies of the commits after it.
  EXPECT_EQ(hddp::listStateFiles(b),
            (std::vector<std::string>{hddp::stateFileName(b, 7), hddp::stateFileName(b, 9)}));
  EXPECT_EQ(hddp::readStateFile(hddp::stateFileName(b, 7)).size(),
            hddp::readStateFile(hddp::stateFileName(a, 7)).size());
  // The same job with one shared folder and no interruption.
  std::vector<std::vector<at::Tensor>> straight(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, shared, 9, nullptr, &straight[static_cast<size_t>(rank)]);
  });
  {
    SCOPED_TRACE("resumed against straight");
    expectSameParameters(resumed[0], straight[0]);
  }
  {
    SCOPED_TRACE("rank 1 against rank 0");
    expectSameParameters(resumed[1], resumed[0]);
  }
}

// A save folder per rank and a --resume that names rank 0's (issue #48, item 1): whether
// the resume is the save folder, and whether the cached folder groups are stale, are
// agreed by every rank. Before, rank 0 took fold0 for its save folder and kept the groups
// found for it while rank 1 found them again at the first save: rank 0 waited in
// partsToWriters (ZeRO), rank 1 in folderGroups, until the timeout.
TEST(CommitFolders, AResumeOfOneRanksFolderIsDecidedTogether) {
  const std::string root = hddp::testing::makeTempDir();
  auto fold = [&](int rank) { return root + "/fold" + std::to_string(rank); };
  auto zero = [](int stage) {
    return [stage](hddp::TrainerOptions& o) {
      o.zero = stage;
      o.shardBy = hddp::parseShardBy("equal");
    };
  };
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, fold(rank), /*maxSteps=*/4, nullptr, nullptr, zero(2));
  });
  for (const auto& e : fs::directory_iterator(fold(0))) {
    fs::remove(e.path());  // rank 0's folder emptied
  }
  std::vector<hddp::TrainSummary> summaries(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] = train(rank, size, store, fold(rank), /*maxSteps=*/8,
                                                 nullptr, nullptr, [&](hddp::TrainerOptions& o) {
                                                   zero(1)(o);
                                                   o.resume = fold(0);
                                                 });
  });
  for (const auto& s : summaries) {
    EXPECT_EQ(s.steps, 8) << "fold0 holds nothing: the run starts fresh on every rank";
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(fs::exists(hddp::stateFileName(fold(r), 8))) << fold(r);
  }
  // A launcher's restart whose save folders hold nothing: every rank goes on to --resume
  // together (before, rank 0 skipped it as its own save folder, already searched, and
  // rank 1 loaded fold0 alone).
  for (int r = 0; r < 2; ++r) {
    for (const auto& e : fs::directory_iterator(fold(r))) {
      fs::remove(e.path());
    }
  }
  hddp::LaunchInfo restarted;
  restarted.jobRestarts = 1;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] =
        train(rank, size, store, fold(rank), /*maxSteps=*/3, &restarted, nullptr,
              [&](hddp::TrainerOptions& o) { o.resume = fold(0); });
  });
  for (const auto& s : summaries) {
    EXPECT_EQ(s.steps, 3);
  }
  // A save folder on some ranks only is a ConfigError on every rank, not a hang.
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      train(rank, size, store, rank == 0 ? fold(0) : std::string(), 2, nullptr, nullptr,
            [&](hddp::TrainerOptions& o) { o.saveEvery = rank == 0 ? 3 : 0; });
    } catch (const hddp::ConfigError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("the ranks were given different TrainerOptions::saveDir (rank 0: given, "
                     "rank 1: none)"),
              std::string::npos)
        << e;
  }
}

// Two folders holding different files of the same step (rank 1's folder was reused from
// another attempt, which trained in another order): every rank loads the lowest folder's
// file, so the ranks start from one state. Before, each loaded its own copy and the
// replicas trained on apart from each other without a word.
TEST(CommitFolders, FilesOfTheSameStepWithOtherBytesAreReplacedNotLoaded) {
  const std::string root = hddp::testing::makeTempDir();
  const std::string a = root + "/a", b = root + "/b", other = root + "/other";
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, rank == 0 ? a : b, /*maxSteps=*/4, nullptr);
  });
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, other, /*maxSteps=*/4, nullptr, nullptr,
          [](hddp::TrainerOptions& o) { o.seed = 11; });  // another order of the samples
  });
  fs::copy_file(hddp::stateFileName(other, 4), hddp::stateFileName(b, 4),
                fs::copy_options::overwrite_existing);
  ASSERT_NE(hddp::readStateFile(hddp::stateFileName(a, 4)),
            hddp::readStateFile(hddp::stateFileName(b, 4)));
  hddp::LaunchInfo restarted;
  restarted.jobRestarts = 1;
  std::vector<std::vector<at::Tensor>> params(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, rank == 0 ? a : b, /*maxSteps=*/5, &restarted,
          &params[static_cast<size_t>(rank)]);
  });
  ASSERT_EQ(params[0].size(), params[1].size());
  for (size_t i = 0; i < params[0].size(); ++i) {
    EXPECT_TRUE(at::equal(params[0][i], params[1][i])) << "tensor " << i << ": the ranks differ";
  }
  // b's file of step 4 was replaced by a's (the folders keep the commit they load).
  EXPECT_EQ(hddp::readStateFile(hddp::stateFileName(a, 4)),
            hddp::readStateFile(hddp::stateFileName(b, 4)));
}

// Folders per rank, restarted untouched: each writer's copy of a commit holds its own
// clock's readings, yet both are the same commit (the id every writer wrote), so nothing
// is sent and no folder's file is replaced. Before, the copies' bytes were compared, so
// every such restart sent rank 0's file to rank 1 and overwrote rank 1's copy.
TEST(CommitFolders, AnUntouchedRestartOfFoldersPerRankSendsNothing) {
  const std::string root = hddp::testing::makeTempDir();
  const std::string a = root + "/a", b = root + "/b";
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, rank == 0 ? a : b, /*maxSteps=*/4, nullptr);
  });
  const std::string before = hddp::readStateFile(hddp::stateFileName(b, 4));
  ASSERT_NE(hddp::readStateFile(hddp::stateFileName(a, 4)), before)
      << "the copies are alike: this test would not see bytes compared";
  hddp::LaunchInfo restarted;
  restarted.jobRestarts = 1;
  std::vector<std::vector<at::Tensor>> params(2);
  std::vector<hddp::TrainSummary> summaries(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] =
        train(rank, size, store, rank == 0 ? a : b,
              /*maxSteps=*/5, &restarted, &params[static_cast<size_t>(rank)]);
  });
  EXPECT_EQ(summaries[0].steps, 1) << "resumed at step 4";
  for (size_t i = 0; i < params[0].size(); ++i) {
    EXPECT_TRUE(at::equal(params[0][i], params[1][i])) << "tensor " << i << ": the ranks differ";
  }
  EXPECT_EQ(hddp::readStateFile(hddp::stateFileName(b, 4)), before)
      << "rank 1's copy of step 4 was replaced by rank 0's";
}

// A folder whose files are all damaged is passed over when another folder has a valid
// commit; with none valid anywhere it is the error it always was.
TEST(CommitFolders, DamagedFilesInOneFolderGiveWayToAnotherFoldersCommit) {
  const std::string root = hddp::testing::makeTempDir();
  const std::string a = root + "/a", b = root + "/b";
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    train(rank, size, store, rank == 0 ? a : b, /*maxSteps=*/4, nullptr);
  });
  for (const auto& f : hddp::listStateFiles(a)) {
    damage(f);
  }
  hddp::LaunchInfo restarted;
  restarted.jobRestarts = 1;
  std::vector<hddp::TrainSummary> summaries(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[static_cast<size_t>(rank)] =
        train(rank, size, store, rank == 0 ? a : b, 6, &restarted);
  });
  EXPECT_EQ(summaries[0].steps, 2) << "resumed at step 4 from b's commit";
  EXPECT_EQ(summaries[0].totalSteps, 6);
  // a's damaged copy of step 4 was replaced by the one received.
  EXPECT_NO_THROW(hddp::readStateFile(hddp::stateFileName(a, 4)));
  for (const auto& f : hddp::listStateFiles(b)) {
    damage(f);
  }
  for (const auto& f : hddp::listStateFiles(a)) {
    damage(f);
  }
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      train(rank, size, store, rank == 0 ? a : b, 8, &restarted);
    } catch (const hddp::StateError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("is valid"), std::string::npos) << e;
  }
}

// Under torchrun's agent a generation after a membership change has restart count 0: it
// resumes the commits of its own job (the id torchrun gives), never another job's.
TEST(CommitFolders, UnderTorchrunsAgentAGenerationResumesOnlyItsOwnJobsCommits) {
  const std::string dir = hddp::testing::makeTempDir();
  {
    hddp::testing::ScopedEnv agent("TORCHELASTIC_USE_AGENT_STORE", "False");
    hddp::testing::ScopedEnv id("TORCHELASTIC_RUN_ID", "job-1");
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      train(rank, size, store, dir, /*maxSteps=*/6, nullptr);
    });
  }
  hddp::LaunchInfo firstGeneration;  // restart count 0, as torchrun gives after a join
  std::vector<hddp::TrainSummary> other(2), same(2);
  {
    hddp::testing::ScopedEnv agent("TORCHELASTIC_USE_AGENT_STORE", "False");
    hddp::testing::ScopedEnv id("TORCHELASTIC_RUN_ID", "job-2");
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      other[static_cast<size_t>(rank)] = train(rank, size, store, dir, 3, &firstGeneration);
    });
  }
  EXPECT_EQ(other[0].steps, 3) << "another job's commits are not resumed";
  // job-2 left its own commit at step 3; job-1's newest is step 6, which job-1 resumes.
  {
    hddp::testing::ScopedEnv agent("TORCHELASTIC_USE_AGENT_STORE", "False");
    hddp::testing::ScopedEnv id("TORCHELASTIC_RUN_ID", "job-1");
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      same[static_cast<size_t>(rank)] = train(rank, size, store, dir, 9, &firstGeneration);
    });
  }
  EXPECT_EQ(same[0].totalSteps, 9);
  EXPECT_EQ(same[0].steps, 3) << "job-1 resumed its own step 6";
}

// The round of a generation on a store that outlives generations: an earlier
// generation's complete round is passed over, whichever rank comes first.
TEST(Round, EachGenerationAgreesOnAFreshRoundOnAStoreThatOutlivesIt) {
  hddp::Store store = hddp::Store::memory(std::chrono::seconds(20));
  std::set<std::string> rounds;
  for (int generation = 0; generation < 4; ++generation) {
    const int size = generation % 2 == 0 ? 3 : 1;
    std::vector<std::string> got(static_cast<size_t>(size));
    std::vector<std::thread> ranks;
    for (int rank = size - 1; rank >= 0; --rank) {  // the others before rank 0
      ranks.emplace_back([&, rank] {
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        hddp::Store mine = store;
        got[static_cast<size_t>(rank)] =
            hddp::agreeOnRound(mine, rank, size, std::chrono::seconds(20));
      });
    }
    for (auto& t : ranks) {
      t.join();
    }
    for (const auto& g : got) {
      EXPECT_EQ(g, got[0]) << "generation " << generation;
    }
    EXPECT_TRUE(rounds.insert(got[0]).second)
        << "generation " << generation << " took an earlier round";
  }
}

// torchrun's agents count their own failures: ranks with different restart counts (a
// node that joined, one that restarted) meet, with the agent's store (one that an earlier
// generation's round is left in) and without (rank 0 hosts a fresh one).
void ranksWithDifferentRestartCountsMeet(bool agentStore) {
  auto outcomes = hddp::testing::runProcesses(
      2,
      [agentStore](int rank, int size, hddp::Store& coordination) {
        setenv("HDDP_DEVICE", "cpu", 1);
        setenv("HDDP_TIMEOUT_SEC", "15", 1);
        std::unique_ptr<hddp::Store> agent;
        if (rank == 0) {
          hddp::TcpStoreOptions o;
          o.port = 0;
          o.isServer = true;
          agent = std::make_unique<hddp::Store>(hddp::Store::tcp(o));
          agent->set("hddp/round", std::string("earlier"));
          agent->set("hddp/round/earlier/go", std::string("1"));
          coordination.set("port", std::to_string(agent->port()));
          if (!agentStore) {
            agent.reset();  // the port is free again: rank 0 hosts the job's store there
          }
        }
        const std::string port = coordination.getString("port");
        setenv("RANK", std::to_string(rank).c_str(), 1);
        setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", port.c_str(), 1);
        setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(rank * 2).c_str(), 1);
        setenv("TORCHELASTIC_USE_AGENT_STORE", agentStore ? "True" : "False", 1);
        auto ctx = hddp::initFromEnv();
        auto t = torch::ones({8});
        ctx.communicator->allreduce(t).wait();
        EXPECT_TRUE(t.equal(torch::full({8}, 2.0f)));
        coordination.add("done", 1);
        while (agent && coordination.add("done", 0) < size) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the server stays up
        }
      },
      std::chrono::seconds(90));
  hddp::testing::expectAllSucceeded(outcomes);
}

TEST(Processes, TorchrunRanksWithDifferentRestartCountsMeetOnTheAgentsStore) {
  ranksWithDifferentRestartCountsMeet(true);
}

TEST(Processes, TorchrunRanksWithDifferentRestartCountsMeetOnRank0sStore) {
  ranksWithDifferentRestartCountsMeet(false);
}
