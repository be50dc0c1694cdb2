// Crash-safe state files: written atomically, verified on load, the last K kept.
//
// Format: an 8-byte magic "HDDPST01", the payload length (uint64, little-endian), its
// CRC-32, then the payload (the Trainer's: a torch archive). Writing goes to
// `name.tmp`, is fsync'ed, renamed over `name`, and the directory is fsync'ed: a crash
// at any point leaves either the previous files or the complete new one, never a torn
// file under a final name. Loading checks magic, length and checksum and raises
// hddp::StateError saying what is wrong and what to do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hddp {

/// Writes `payload` to `path` atomically (temp file, fsync, rename, directory fsync).
void writeStateFile(const std::string& path, const std::string& payload);

/// Reads and verifies a state file; returns the payload. Throws hddp::StateError.
std::string readStateFile(const std::string& path);

/// CRC-32 (IEEE, as zlib) of `data`.
uint32_t crc32Of(const void* data, size_t size);

/// State files in `dir` named `prefix`NNNNNNNN.hddp, sorted by step (oldest first).
std::vector<std::string> listStateFiles(const std::string& dir,
                                        const std::string& prefix = "state-");

/// Deletes all but the newest `keep` state files of `dir` (and stray .tmp files).
void pruneStateFiles(const std::string& dir, int keep, const std::string& prefix = "state-");

/// `dir`/`prefix`<step, 8 digits>.hddp
std::string stateFileName(const std::string& dir, int64_t step,
                          const std::string& prefix = "state-");

}  // namespace hddp
