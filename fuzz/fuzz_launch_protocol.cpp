// The launch protocol a rank reads from outside (src/comm/launch.cpp, protocol/launch.cpp,
// src/core/env.cpp's parsers): the input is an environment, one NAME=VALUE per line
// (torchrun's, Slurm's and Open MPI's variables, hddp-run's HDDP_*), read by
// hddp::detectLaunch and hddp::detectJob; each name is also tried as a progress mark's file
// name, and the input's first 16 bytes as a progress mark (two int64).
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp/comm/launch.h"
#include "hddp_protocol/launch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  hddp::EnvMap env;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    end = end == std::string::npos ? text.size() : end;
    const std::string line = text.substr(at, end - at);
    const size_t eq = line.find('=');
    if (eq != std::string::npos) {
      env[line.substr(0, eq)] = line.substr(eq + 1);
    }
    at = end + 1;
  }
  hddp::fuzz::refusedCleanly("detectLaunch", [&] { hddp::detectLaunch({}, env); });
  hddp::fuzz::refusedCleanly("detectJob", [&] { hddp::detectJob(env); });
  hddp::fuzz::refusedCleanly("progressMarkSlot", [&] {
    for (const auto& [name, value] : env) {
      hddp::protocol::progressMarkSlot(name);
      hddp::protocol::progressMarkSlot(value);
    }
  });
  const std::string mark = hddp::fuzz::writeInput(data, size, "progress.slot0");
  hddp::protocol::readProgressMark(mark);
  return 0;
}
