// The live line: a progress bar redrawn in place on stderr ('\r', no newline). While one
// is open, the next log line clears it first and is written whole on its own line; the
// bar comes back at its next redraw. Kept apart from logging.h so that only the two
// sides that meet here (the log and the progress bar) include it.
//
// Thread safety: both calls are lock-free and may come from any thread.
#pragma once

namespace hddp {
namespace log {

/// The progress bar says whether it left a line open on stderr (drawn, no newline).
void setLiveLineOpen(bool open) noexcept;

/// Closes the open live line, if any, and says whether there was one. `clear`: wipe it
/// ("\r" + erase line), for a log line that takes its place; otherwise end it with a
/// newline so it stays on screen (an epoch's last bar above its summary).
bool closeLiveLine(bool clear) noexcept;

}  // namespace log
}  // namespace hddp
