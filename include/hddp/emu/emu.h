#pragma once

// hddp::emu: an emulated accelerator that runs on the CPU, so that the device code paths
// of a training program (device tensors, side streams, events, record_stream, pinned
// memory, device memory statistics, unlike devices) run in CI on a machine without a GPU.
//
// What it is. install() registers LibTorch's PrivateUse1 backend under the name "emu":
// after it, torch::Device("emu:1"), tensor.to("emu:0"), torch::zeros({2}, device) and
// autograd work as on any device. Every operator computes on CPU copies of its inputs
// (ATen's boxed CPU fallback); device memory is host memory from emu's own allocator,
// which keeps statistics behind c10::getDeviceAllocator(c10::DeviceType::PrivateUse1).
//
// The contract, as on CUDA:
//  - The default stream (id 0) of each device is synchronous with the host: its work runs
//    at once on the calling thread. Copies issued while a side stream is current
//    (c10::StreamGuard) are queued and run later, in order, on that stream's own thread;
//    other operators issued on a side stream first wait for its queue, then run on the
//    calling thread. Events and stream waits order the streams.
//  - Stream safety is checked logically, not by timing: every stream keeps a count of its
//    work, every device memory block remembers its last writer and its users. Using a block
//    on a stream (or overwriting it) that is not ordered after the other stream's last
//    write or read, by an event wait or a host synchronisation, throws a c10::Error from
//    the operator. Freeing a block used by a stream other than its allocation stream
//    without record_stream is a violation, unless the allocation stream or the host is
//    ordered after that use (then CUDA could reuse the block safely too). Frees happen in
//    deleters, so it is logged to stderr, stored (violations()) and thrown by the next emu
//    operator that touches data (a copy, item() or any fallback operator) or by
//    checkNoViolations(). Fresh device and pinned memory holds 0xFF bytes (NaN for
//    floats), so a host read of a non_blocking copy before synchronising gives a visibly
//    wrong result. Memory still referenced by queued work is kept until that work ran.
//  - An operator whose tensors lie on two emu devices, or that mixes a CPU tensor with
//    emu tensors, is refused as CUDA refuses it (the CPU fallback alone would compute
//    it); CPU scalars (0-dim) and CPU index tensors of index / index_put_ are allowed.
//  - Device i with slowdown factor f > 1 sleeps (f - 1) times each operator's measured
//    compute time after it; counters() reports both times.
//
// Environment (read by optionsFromEnv(); an explicit EmuOptions wins over it):
//   HDDP_EMU_DEVICES          number of devices, an integer 1..64; default 2
//   HDDP_EMU_SLOWDOWN         per-device factors "1:3,2:1.5" (emu:1 runs 3x slower); default none
//   HDDP_EMU_MEMORY_GIB       memory total per device in GiB (> 0); default 16
//   HDDP_EMU_STREAM_DELAY_MS  milliseconds each queued side-stream task waits before it
//                             runs (>= 0; makes races certain in tests); default 0
//
// Thread safety: every function here may be called from any thread. The current device and
// the current stream per device are per thread, as on CUDA. The backend, once installed,
// lives for the rest of the process (LibTorch cannot unregister a PrivateUse1 backend), so
// install() returns no handle; its streams' threads are never joined.

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hddp {
namespace emu {

/// How the emulated devices behave. Every field has the default written here; the
/// environment variable in brackets sets it through optionsFromEnv().
struct EmuOptions {
  /// Number of devices emu:0 .. emu:N-1 (1..64). Fixed by the first install().
  /// Default 2 [HDDP_EMU_DEVICES].
  int deviceCount = 2;
  /// Slowdown factor (>= 1) by device index; devices not listed run at full speed.
  /// Default: none [HDDP_EMU_SLOWDOWN, e.g. "1:3"].
  std::map<int, double> slowdown;
  /// Memory total per device, in bytes; an allocation above it throws
  /// c10::OutOfMemoryError. Default 16 GiB [HDDP_EMU_MEMORY_GIB].
  int64_t memoryBytes = int64_t{16} << 30;
  /// Delay before each queued side-stream task runs. Default 0 [HDDP_EMU_STREAM_DELAY_MS].
  std::chrono::milliseconds streamDelay{0};
};

/// The options the environment asks for (the defaults above where a variable is unset).
/// Throws c10::Error naming the variable, its value and what is expected when a value is
/// malformed.
EmuOptions optionsFromEnv();

/// Registers the backend "emu" (once) and applies `options`: slowdown factors, memory totals
/// and the stream delay are replaced on every call. Idempotent. Throws c10::Error when the
/// options are invalid, when another PrivateUse1 backend is already registered, or when a
/// later call asks for a different device count.
void install(const EmuOptions& options);
/// install(optionsFromEnv()).
void install();

/// Whether install() has run in this process.
bool isInstalled();

/// Number of emulated devices (0 before install()).
int deviceCount();

/// Sets the memory total of emu:`device`, in bytes (> 0). Allocations already made stay.
void setMemoryTotal(int device, int64_t bytes);
/// The memory total of emu:`device`, in bytes.
int64_t memoryTotal(int device);

/// Sets the slowdown factor (>= 1) of emu:`device`; 1 runs at full speed.
void setSlowdown(int device, double factor);

/// Sets the delay before each queued side-stream task runs (>= 0), for tests.
void setStreamDelay(std::chrono::milliseconds delay);

/// Declares emu:`device` the only emu device this process computes on (a rank's device);
/// -1 (the default) allows every device. An allocation on another emu device, which
/// takes the allocating thread's current device, then counts as a violation, stored
/// with the backtrace of its first occurrence per device: on a GPU the same slip puts a
/// rank's memory (and a CUDA context) on another rank's card. Make the rank's device
/// current (c10::DeviceGuard, or once per thread as torch.cuda.set_device does) or give
/// factories a device with an index.
void setOwnDevice(int device);
/// The device set by setOwnDevice() (-1: none).
int ownDevice();

/// What emu:i has computed since install() or resetCounters().
struct DeviceCounters {
  /// Operators run (boxed-fallback operators and top-level copies).
  int64_t ops = 0;
  /// Measured compute time of those operators, in seconds.
  double computeSeconds = 0;
  /// Time slept to emulate the slowdown, in seconds: exactly (factor - 1) x computeSeconds.
  double slowdownSeconds = 0;
};
DeviceCounters counters(int device);
void resetCounters();

/// Violations found at free time (missing record_stream), oldest first, until cleared.
std::vector<std::string> violations();
/// Forgets the stored violations.
void clearViolations();
/// Throws c10::Error listing the stored violations, if there are any.
void checkNoViolations();

}  // namespace emu
}  // namespace hddp
