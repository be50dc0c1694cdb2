#pragma once

// Private to hddp::emu: the logical stream-safety check. Each stream counts its work
// (sequence numbers from 1) and keeps a vector clock: for every stream, how far it is known
// to be ordered after that stream's work (by event waits, and by host synchronisations,
// which order everything issued later). Each device memory block remembers its last writer
// and, per stream, its last use and last read. The check depends on what was issued and
// waited for, never on timing.

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <unordered_map>
#include <vector>

namespace hddp {
namespace emu {
namespace detail {

/// How far one party is ordered after each stream's work: stream key -> sequence number.
class Clock {
 public:
  uint64_t at(uint64_t stream) const;
  void raise(uint64_t stream, uint64_t seq);
  void merge(const Clock& other);

 private:
  std::unordered_map<uint64_t, uint64_t> seen_;
};

uint64_t streamKey(c10::Stream stream);
/// "emu:0 default stream", "emu:1 side stream 3".
std::string describeStream(c10::Stream stream);

/// One tensor an operator reads or writes.
struct Access {
  const at::Tensor* tensor;
  bool write;
};

/// Checks that `stream` may run `op` on `accesses` now; throws c10::Error naming the
/// tensor, the stream still using it and the fix when it may not. Also throws a stored
/// violation not yet reported. On success, counts the work and records the uses; returns
/// its sequence number.
uint64_t issue(c10::Stream stream, std::initializer_list<Access> accesses, const char* op);

/// Event support: `stream`'s clock now (including its own work so far).
Clock snapshot(c10::Stream stream);
/// `stream` waits for an event whose clock is `clock`.
void streamWaits(c10::Stream stream, const Clock& clock);
/// The host waited for an event whose clock is `clock`.
void hostWaits(const Clock& clock);
/// The host synchronised `stream` / every stream of `device`.
void hostSyncStream(c10::Stream stream);
void hostSyncDevice(c10::DeviceIndex device);

/// Block bookkeeping, called by the allocator.
void onAllocate(const void* base, size_t bytes, c10::Stream allocationStream);
void onFree(const void* base) noexcept;
void recordStream(const void* base, c10::Stream stream);

/// Stores `text` as a violation (printed to stderr now; thrown by the next issue()).
void addViolation(const std::string& text);
std::vector<std::string> storedViolations();
void clearStoredViolations();

}  // namespace detail
}  // namespace emu
}  // namespace hddp
