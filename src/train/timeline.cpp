#include "hddp/train/timeline.h"

#include <fstream>
#include <sstream>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

std::string Timeline::serialize(int rank) const {
  std::ostringstream out;
  out.precision(3);
  out << std::fixed;
  bool first = true;
  auto micros = [this](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  };
  // Names of the rank's row and tracks.
  out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"args\":{\"name\":\"rank "
      << rank << "\"}},";
  out << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank
      << ",\"tid\":0,\"args\":{\"name\":\"training\"}},";
  out << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank
      << ",\"tid\":1,\"args\":{\"name\":\"allreduce\"}}";
  first = false;
  for (const auto& e : events_) {
    if (!first) {
      out << ",";
    }
    first = false;
    out << "{\"name\":\"" << e.name << "\",\"ph\":\"X\",\"pid\":" << rank
        << ",\"tid\":" << static_cast<int>(e.track) << ",\"ts\":" << micros(e.begin)
        << ",\"dur\":" << micros(e.end) - micros(e.begin) << ",\"args\":{\"step\":" << e.step;
    if (e.value >= 0) {
      out << ",\"value\":" << e.value;
    }
    out << "}}";
  }
  return out.str();
}

void Timeline::write(Communicator& communicator, const std::string& path) const {
  const std::string mine = serialize(communicator.rank());
  const auto all = communicator.allgatherBytes(std::vector<uint8_t>(mine.begin(), mine.end()));
  if (communicator.rank() != 0) {
    return;
  }
  std::ofstream out(path, std::ios::trunc);
  HDDP_CHECK(out.good(), "cannot write the timeline to ", path);
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  for (size_t r = 0; r < all.size(); ++r) {
    if (r) {
      out << ",";
    }
    out.write(reinterpret_cast<const char*>(all[r].data()),
              static_cast<std::streamsize>(all[r].size()));
  }
  out << "]}\n";
  HDDP_CHECK(out.good(), "error writing the timeline to ", path);
  HDDP_LOG_INFO("train", "timeline of ", all.size(), " ranks written to ", path,
                " (open in https://ui.perfetto.dev)");
}

}  // namespace hddp
