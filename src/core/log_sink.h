// The spdlog side of hddp logging. This header and log_sink.cpp see neither LibTorch
// nor c10: LibTorch ships its own fmt, and keeping spdlog's fmt in a translation unit
// of its own means the two never meet.
#pragma once

#include <cstddef>

namespace hddp {
namespace log {
namespace sink {

// level: 0 trace .. 5 off, as hddp::log::Level.
void write(const char* layer, int level, const char* message, std::size_t length) noexcept;
/// The rank in every line's prefix (-1: none); kept here only.
void setRank(int rank) noexcept;
int rank() noexcept;
/// The launcher prefixes each stderr line with the rank: the pattern leaves it out.
void setRankInLauncherPrefix(bool prefixed) noexcept;

}  // namespace sink
}  // namespace log
}  // namespace hddp
