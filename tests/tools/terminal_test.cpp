// hddp-run's terminal (tools/hddp-run/group.h): rank 0's live bar passes through, and a
// line of another rank (or of hddp-run) clears the bar, is written whole, and the bar
// is drawn again below it.
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <termios.h>
#include <unistd.h>

#include <string>

#include "group.h"

namespace {

// What the terminal holds; with `want`, waits (up to 10 s) until that many bytes came:
// two writes may reach the reader apart on a loaded machine.
std::string readAll(int fd, size_t want = 0) {
  std::string out;
  char buf[4096];
  for (;;) {
    if (want > 0 && out.size() < want) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 10000) <= 0) {
        break;
      }
    }
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) {
      break;
    }
    out.append(buf, static_cast<size_t>(n));
    if (out.size() >= want && static_cast<size_t>(n) < sizeof(buf)) {
      break;
    }
  }
  return out;
}

TEST(HddpRunTerminal, AnotherRanksLineClearsTheBarAndTheBarComesBack) {
  int master = -1;
  int slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  termios t{};
  ASSERT_EQ(tcgetattr(slave, &t), 0);
  cfmakeraw(&t);
  ASSERT_EQ(tcsetattr(slave, TCSANOW, &t), 0);
  hddp::run::detail::Terminal terminal;
  const std::string first = "\r\033[Kepoch 1/3 [##....] 2/6";
  const std::string second = "\r\033[Kepoch 1/3 [####..] 4/6";
  terminal.passThrough(slave, first.data(), first.size());
  terminal.passThrough(slave, second.data(), second.size());
  EXPECT_EQ(readAll(master, (first + second).size()), first + second);
  EXPECT_EQ(terminal.bar, second) << "only the newest redraw is kept";
  terminal.write(slave, "[rank 1] a message\n");
  EXPECT_EQ(readAll(master, ("\r\033[K[rank 1] a message\n" + second).size()),
            "\r\033[K[rank 1] a message\n" + second);
  // Rank 0's own log line written onto its bar: the bar is cleared first, the line
  // written whole, and the bar drawn again (it was written onto the bar's text).
  const std::string own = "[2026-12-04 19:30:27.630] [rank 0] [hddp.balance] [info] plan\n";
  terminal.passThrough(slave, own.data(), own.size());
  EXPECT_EQ(readAll(master, ("\r\033[K" + own + second).size()), "\r\033[K" + own + second);
  EXPECT_EQ(terminal.bar, second);
  const std::string end = "\nepoch 1/3: train loss 1.2\n";
  terminal.passThrough(slave, end.data(), end.size());
  EXPECT_TRUE(terminal.bar.empty());
  readAll(master);
  terminal.write(slave, "[rank 1] no bar now\n");
  EXPECT_EQ(readAll(master, 20), "[rank 1] no bar now\n");
  // Not a terminal (a file, a pipe): lines are written as they are.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  terminal.passThrough(slave, second.data(), second.size());
  readAll(master);
  terminal.write(fds[1], "[rank 1] to a pipe\n");
  close(fds[1]);
  EXPECT_EQ(readAll(fds[0], 19), "[rank 1] to a pipe\n");
  close(fds[0]);
  close(master);
  close(slave);
}

}  // namespace
