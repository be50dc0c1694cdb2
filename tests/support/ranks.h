// Many ranks on one machine, for tests.
//
// runThreads: N threads of this process, each with its rank, over one in-memory store.
// runProcesses: N processes that re-run the calling test (this binary with
//   --gtest_filter=<current test>), over a TCPStore this process hosts on a free
//   loopback port. In a child, runProcesses runs `body` for the child's rank and exits;
//   in the parent it returns how each child ended, so a test can assert on exit codes
//   and signals (fault injection).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "hddp/comm/store.h"

namespace hddp {
namespace testing {

using RankBody = std::function<void(int rank, int size, Store& store)>;

void runThreads(int size, const RankBody& body,
                std::chrono::milliseconds storeTimeout = std::chrono::seconds(60));

struct ProcessOutcome {
  int rank = 0;
  bool exited = false;  // exited normally (else killed by a signal)
  int exitCode = -1;
  int signal = 0;
  std::string output;  // stdout + stderr
};

/// Returns only in the parent. `timeout` bounds the whole group; children still
/// running then are killed (and reported with signal SIGKILL).
std::vector<ProcessOutcome> runProcesses(int size, const RankBody& body,
                                         std::chrono::seconds timeout = std::chrono::seconds(120));

/// Expects every child to have exited with code 0; prints their output otherwise.
void expectAllSucceeded(const std::vector<ProcessOutcome>& outcomes);

/// Path of the directory holding the built tools (hddp-run), set by CMake.
std::string toolsDir();

struct CommandResult {
  int exitCode;
  std::string output;  // stdout and stderr
  double seconds;
};

/// Runs a shell command and collects its output. The ranks it starts run on the CPU on
/// every machine (on a GPU machine they would otherwise take cuda:<local rank>);
/// hddp-run --devices sets HDDP_DEVICE itself.
CommandResult runCommand(const std::string& command);

/// runCommand with the command's stdin, stdout and stderr on a pseudo-terminal (as
/// when a user runs it in a terminal), 100 columns wide; the output as the terminal
/// received it (the terminal turns "\n" into "\r\n").
CommandResult runInTerminal(const std::string& command);

/// A fresh temporary directory (removed by the OS's tmp cleaning; tests keep it small).
std::string makeTempDir();

}  // namespace testing
}  // namespace hddp
