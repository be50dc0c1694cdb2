#include "ranks.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <pty.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "hddp/core/logging.h"

extern char** environ;  // NOLINT

namespace hddp {
namespace testing {

void runThreads(int size, const RankBody& body, std::chrono::milliseconds storeTimeout) {
  Store store = Store::memory(storeTimeout);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        Store mine = store;
        body(r, size, mine);
      } catch (const c10::Error& e) {
        errors[r] = e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (int r = 0; r < size; ++r) {
    EXPECT_TRUE(errors[r].empty()) << "rank " << r << " threw: " << errors[r];
  }
}

namespace {

std::string currentTestFilter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<ProcessOutcome> runProcesses(int size, const RankBody& body,
                                         std::chrono::seconds timeout) {
  if (const char* childRank = std::getenv("HDDP_TEST_CHILD_RANK")) {
    const int rank = std::atoi(childRank);
    const int port = std::atoi(std::getenv("HDDP_TEST_STORE_PORT"));
    int code = 0;
    try {
      log::setRank(rank);
      TcpStoreOptions opts;
      opts.port = static_cast<uint16_t>(port);
      opts.timeout = std::chrono::seconds(60);
      Store store = Store::tcp(opts);
      body(rank, size, store);
      code = ::testing::Test::HasFailure() ? 1 : 0;
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "rank %d threw: %s\n", rank, e.what_without_backtrace());
      code = 2;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d threw: %s\n", rank, e.what());
      code = 2;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);
  }

  TcpStoreOptions serverOpts;
  serverOpts.isServer = true;
  serverOpts.port = 0;
  serverOpts.timeout = std::chrono::seconds(60);
  Store server = Store::tcp(serverOpts);
  const std::string dir = makeTempDir();
  std::vector<pid_t> pids(size, -1);
  std::vector<ProcessOutcome> outcomes(size);
  for (int r = 0; r < size; ++r) {
    outcomes[r].rank = r;
    const std::string outPath = dir + "/rank" + std::to_string(r) + ".log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, outPath.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    std::vector<std::string> envStrings;
    for (char** e = environ; *e; ++e) {
      envStrings.emplace_back(*e);
    }
    envStrings.push_back("HDDP_TEST_CHILD_RANK=" + std::to_string(r));
    envStrings.push_back("HDDP_TEST_STORE_PORT=" + std::to_string(server.port()));
    std::vector<char*> envp;
    for (auto& s : envStrings) {
      envp.push_back(s.data());
    }
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string filter = "--gtest_filter=" + currentTestFilter();
    char* argv[] = {exe.data(), filter.data(), nullptr};
    const int rc = posix_spawn(&pids[r], exe.c_str(), &actions, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0) << "posix_spawn failed for rank " << r;
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int remaining = size;
  std::vector<bool> done(size, false);
  while (remaining > 0) {
    for (int r = 0; r < size; ++r) {
      if (done[r] || pids[r] <= 0) {
        if (!done[r]) {
          done[r] = true;
          --remaining;
        }
        continue;
      }
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        outcomes[r].exited = WIFEXITED(status);
        outcomes[r].exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        outcomes[r].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "ranks still running after " << timeout.count() << " s; killing them";
      for (int r = 0; r < size; ++r) {
        if (!done[r]) {
          kill(pids[r], SIGKILL);
        }
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < size; ++r) {
    outcomes[r].output = readFile(dir + "/rank" + std::to_string(r) + ".log");
  }
  return outcomes;
}

void expectAllSucceeded(const std::vector<ProcessOutcome>& outcomes) {
  for (const auto& o : outcomes) {
    EXPECT_TRUE(o.exited && o.exitCode == 0)
        << "rank " << o.rank << " ended with " << (o.exited ? "exit code " : "signal ")
        << (o.exited ? o.exitCode : o.signal) << "; its output:\n"
        << o.output;
  }
}

std::string toolsDir() { return HDDP_TEST_TOOLS_DIR; }

std::string makeTempDir() {
  std::string tmpl = (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
  tmpl += "/hddp-test-XXXXXX";
  char* made = mkdtemp(tmpl.data());
  if (!made) {
    throw std::runtime_error("mkdtemp failed");
  }
  return made;
}

CommandResult runCommand(const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(("export HDDP_DEVICE=cpu; " + command + " 2>&1").c_str(), "r");
  std::string output;
  std::array<char, 4096> buf{};
  while (pipe && fgets(buf.data(), buf.size(), pipe)) {
    output += buf.data();
  }
  const int status = pipe ? pclose(pipe) : -1;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output, seconds};
}

CommandResult runInTerminal(const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  winsize ws{};
  ws.ws_row = 40;
  ws.ws_col = 100;
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, &ws);
  if (pid < 0) {
    return {-1, std::string("forkpty failed: ") + std::strerror(errno), 0.0};
  }
  if (pid == 0) {
    const std::string line = "export HDDP_DEVICE=cpu; " + command;
    execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string output;
  std::array<char, 4096> buf{};
  for (;;) {
    const ssize_t n = read(master, buf.data(), buf.size());
    if (n > 0) {
      output.append(buf.data(), static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EIO: the command and everything it started closed the terminal
    }
  }
  close(master);
  int status = 0;
  waitpid(pid, &status, 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output, seconds};
}

}  // namespace testing
}  // namespace hddp
