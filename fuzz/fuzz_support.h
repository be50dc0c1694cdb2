// What every fuzz target shares: a per-process scratch folder for readers that take a
// path, and the rule that decides what counts as a finding.
//
// The rule (DESIGN.md, "Readers of outside bytes are bounded"): whatever the bytes, a
// reader returns or throws the error its header documents (hddp::Error, not
// InternalError; the job record's std::runtime_error). Anything else is a finding: a
// sanitizer report, a crash, a hang (-timeout), an allocation beyond -malloc_limit_mb
// (libFuzzer's), or an exception of another type (std::out_of_range from a stoi,
// nlohmann's type_error, std::bad_alloc, a bare c10::Error) -- that one is printed and the
// process aborts, so libFuzzer keeps the input as a crash. Leaks count too (LeakSanitizer;
// fuzz/lsan.supp lists LibTorch's own).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <typeinfo>

#include "hddp/core/error.h"

namespace hddp {
namespace fuzz {

/// A folder of this process's own (tmpfs when there is one), made on first use and
/// reused: the fuzzer runs one input at a time, each overwriting the last one's files.
/// Removed at exit (a crash leaves it, with the input that crashed).
inline const std::string& scratchDir() {
  static const std::string dir = [] {
    const char* base = std::getenv("HDDP_FUZZ_TMP");
    std::string root = base ? base : (access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    std::string pattern = root + "/hddp-fuzz-XXXXXX";
    if (mkdtemp(&pattern[0]) == nullptr) {
      std::perror("hddp fuzz: mkdtemp");
      std::abort();
    }
    static std::string removed;  // for the handler, which takes no argument
    removed = pattern;
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(removed, ignored);
    });
    return pattern;
  }();
  return dir;
}

/// Writes `size` bytes to scratchDir()/`name` (replacing it) and returns the path.
inline std::string writeInput(const uint8_t* data, size_t size, const std::string& name) {
  const std::string path = scratchDir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) {
    std::fprintf(stderr, "hddp fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

/// HDDP_FUZZ_ACCEPT_FOREIGN_ERRORS=1: an exception that is not an hddp::Error (LibTorch's
/// c10::Error or std::runtime_error let through unwrapped, a std::out_of_range) counts as a
/// refusal, not a finding -- to fuzz past a known finding of that kind towards crashes,
/// out-of-bounds accesses and unbounded allocations. Off by default (and in ctest).
inline bool acceptForeignErrors() {
  static const bool accept = std::getenv("HDDP_FUZZ_ACCEPT_FOREIGN_ERRORS") != nullptr;
  return accept;
}

[[noreturn]] inline void finding(const char* what, const char* type, const char* message) {
  std::fprintf(stderr, "\n==hddp-fuzz== FINDING: %s (%s): %s\n", what, type, message);
  std::abort();
}

/// Runs `read`; returns true when it returned, false when it threw an hddp::Error (the
/// documented refusal). Any other outcome is a finding (see above). Set
/// HDDP_FUZZ_SHOW_ERRORS=1 to print each refusal, to see what the reader says.
template <typename Read>
bool refusedCleanly(const char* what, Read&& read) {
  static const bool show = std::getenv("HDDP_FUZZ_SHOW_ERRORS") != nullptr;
  try {
    read();
    return true;
  } catch (const hddp::InternalError& e) {
    finding(what, "hddp::InternalError", e.what_without_backtrace());
  } catch (const hddp::Error& e) {
    if (show) {
      std::fprintf(stderr, "refused: %s\n", e.what_without_backtrace());
    }
    return false;
  } catch (const c10::Error& e) {
    if (!acceptForeignErrors()) {
      finding(what, "c10::Error (not hddp::Error)", e.what_without_backtrace());
    }
    if (show) {
      std::fprintf(stderr, "refused (c10::Error): %s\n", e.what_without_backtrace());
    }
    return false;
  } catch (const std::exception& e) {
    if (!acceptForeignErrors()) {
      finding(what, typeid(e).name(), e.what());
    }
    if (show) {
      std::fprintf(stderr, "refused (%s): %s\n", typeid(e).name(), e.what());
    }
    return false;
  } catch (...) {
    finding(what, "an exception of unknown type", "");
  }
}

/// The same for readers documented to throw std::runtime_error (the job record, which is
/// torch-free): exactly that type; a subclass such as nlohmann's own errors is a finding.
template <typename Read>
bool refusedAsRuntimeError(const char* what, Read&& read) {
  static const bool show = std::getenv("HDDP_FUZZ_SHOW_ERRORS") != nullptr;
  try {
    read();
    return true;
  } catch (const std::exception& e) {
    if (typeid(e) != typeid(std::runtime_error) && !acceptForeignErrors()) {
      finding(what, typeid(e).name(), e.what());
    }
    if (show) {
      std::fprintf(stderr, "refused (%s): %s\n", typeid(e).name(), e.what());
    }
    return false;
  } catch (...) {
    finding(what, "an exception of unknown type", "");
  }
}

}  // namespace fuzz
}  // namespace hddp
