// hddp-run's output (internal): the terminal that rank 0's live progress bar is drawn on,
// the streams that prefix each rank's lines, and rank 0's pseudo-terminal.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <string>

namespace hddp {
namespace run {
namespace detail {

// hddp-run's terminal when rank 0 draws a live progress bar on it: the bar's line as
// last drawn (text after the last newline of rank 0's pseudo-terminal). A line of
// another rank clears the bar, is written, and the bar is drawn again below it.
struct Terminal {
  std::string bar;

  void write(int target, const std::string& text) {
    if (bar.empty() || !isatty(target)) {
      (void)!::write(target, text.data(), text.size());
      return;
    }
    const std::string out = "\r\033[K" + text + bar;
    (void)!::write(target, out.data(), out.size());
  }
  // Rank 0's raw output: passed through, the open line remembered. Text that rank 0
  // writes onto its own open bar (a log line, which neither redraws the bar with '\r'
  // nor ends its line with '\n') clears the bar first, is written whole, and the bar
  // is drawn again below it, as another rank's line is.
  void passThrough(int target, const char* data, size_t n) {
    const std::string chunk(data, n);
    const bool ontoBar = !bar.empty() && bar[0] == '\r' && n > 0 && data[0] != '\r' &&
                         data[0] != '\n' && isatty(target);
    if (ontoBar) {
      const size_t lineEnd = chunk.rfind('\n');
      const std::string out =
          lineEnd == std::string::npos
              ? "\r\033[K" + chunk
              : "\r\033[K" + chunk.substr(0, lineEnd + 1) + bar + chunk.substr(lineEnd + 1);
      (void)!::write(target, out.data(), out.size());
      if (lineEnd == std::string::npos) {
        bar = chunk;  // a line in the making: the bar comes back at the next redraw
      } else if (lineEnd + 1 < chunk.size()) {
        bar = chunk.substr(lineEnd + 1);
      }
      return;
    }
    (void)!::write(target, data, n);
    const size_t nl = chunk.rfind('\n');
    bar = nl == std::string::npos ? bar + chunk : chunk.substr(nl + 1);
    const size_t cr = bar.rfind('\r');
    if (cr != std::string::npos && cr > 0) {
      bar.erase(0, cr);  // only the newest redraw matters
    }
  }
};

/// The one terminal state of this process (rank 0's bar, hddp-run's own messages).
inline Terminal gTerminal;

inline void say(const std::string& text) {
  gTerminal.write(STDERR_FILENO, "hddp-run: " + text + "\n");
}

// Collects a rank's output and writes it line by line with a prefix; or, for rank 0's
// pseudo-terminal (`raw`), passes it through as it comes.
struct Stream {
  int fd = -1;
  int target = STDOUT_FILENO;
  std::string prefix;
  std::string pending;
  Terminal* terminal = nullptr;  // the shared terminal state (null: plain writes)
  bool raw = false;

  void emit(const char* data, size_t n) {
    if (raw && terminal) {
      terminal->passThrough(target, data, n);
      return;
    }
    pending.append(data, n);
    size_t start = 0;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      put(prefix + pending.substr(start, nl - start + 1));
    }
    pending.erase(0, start);
  }
  void flush() {
    if (raw && terminal) {
      if (!terminal->bar.empty()) {
        (void)!::write(target, "\n", 1);  // end the bar's line
        terminal->bar.clear();
      }
      return;
    }
    if (!pending.empty()) {
      put(prefix + pending + "\n");
      pending.clear();
    }
  }
  void put(const std::string& line) {
    if (terminal) {
      terminal->write(target, line);
    } else {
      (void)!::write(target, line.data(), line.size());
    }
  }
};

// A pseudo-terminal for rank 0's stderr (so that its live progress bar shows under
// hddp-run): the master for hddp-run, the slave for the rank, output not post-processed
// (no \n -> \r\n) and the size of hddp-run's own terminal. Returns false when none can
// be made (the rank then gets a pipe).
inline bool openPseudoTerminal(int& master, int& slave) {
  master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) {
    if (master >= 0) {
      close(master);
    }
    return false;
  }
  char name[128];
  if (ptsname_r(master, name, sizeof(name)) != 0 ||
      (slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
    close(master);
    return false;
  }
  termios t{};
  if (tcgetattr(slave, &t) == 0) {
    t.c_oflag &= ~static_cast<tcflag_t>(OPOST);
    tcsetattr(slave, TCSANOW, &t);
  }
  winsize ws{};
  if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0) {
    ioctl(master, TIOCSWINSZ, &ws);
  }
  return true;
}

}  // namespace detail
}  // namespace run
}  // namespace hddp
