// A rank's memory per step (internal to the train layer): on a device the caching
// allocator's bytes (peak allocated and reserved in the step, through the
// device-generic c10 allocator interface), on the CPU the process's resident set; or
// the emulated device memory of HDDP_EMULATE_MEMORY. What the metrics carry and what
// the planner derives memory caps from (hddp/balance/memory_model.h).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

#include "hddp/balance/emulation.h"
#include "hddp/balance/memory_model.h"

namespace hddp {
namespace train {

struct MemoryReading {
  bool valid = false;
  bool emulated = false;
  bool device = false;           // an allocator's figures (a device, or emulated)
  double baseBytes = 0;          // allocated when the step began
  double peakBytes = 0;          // peak allocated in the step
  double reservedPeakBytes = 0;  // peak the allocator held from the device
  double totalBytes = 0;         // the device's memory
  double otherBytes = 0;         // held on the device by others (and the driver)
  double residentBytes = 0;      // the process's resident set (CPU ranks; 0 elsewhere)
  /// What the planner learns from (an allocator's figures only: a CPU rank's resident
  /// set mixes the ranks' libraries and the allocator's caches; no cap is derived).
  MemoryObservation observation(int64_t samples) const;
  /// The figure a user watches: peak allocated on a device, else the resident set.
  double peak() const { return device ? peakBytes : residentBytes; }
};

class MemoryMeter {
 public:
  MemoryMeter() = default;
  MemoryMeter(c10::Device device, const EmulationOptions& emulation);
  /// At the step's start: resets the allocator's peak and reads what is held.
  void beginStep();
  /// After the step's optimizer update.
  MemoryReading endStep(int64_t samples);
  /// The device's free memory now (the allocator's reading; emulated: total minus the
  /// fixed part); -1 where it cannot be measured (a CPU rank).
  double freeBytes() const;

 private:
  c10::Device device_{c10::kCPU};
  EmulationOptions emulation_;
  double base_ = 0;
};

}  // namespace train
}  // namespace hddp
