#include "train/memory_meter.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace hddp {
namespace train {
namespace {

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

// The process's resident set (/proc/self/statm's second field, in pages).
double residentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) {
    return 0;
  }
  long long size = 0;
  long long resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE))
                : 0.0;
}

}  // namespace

MemoryObservation MemoryReading::observation(int64_t samples) const {
  MemoryObservation o;
  if (!valid || !device) {
    return o;
  }
  o.samples = samples;
  o.baseBytes = baseBytes;
  o.peakBytes = peakBytes;
  o.totalBytes = totalBytes;
  o.otherBytes = otherBytes;
  return o;
}

MemoryMeter::MemoryMeter(c10::Device device, const EmulationOptions& emulation)
    : device_(device), emulation_(emulation) {}

void MemoryMeter::beginStep() {
  if (emulation_.emulatesMemory() || device_.is_cpu()) {
    return;
  }
  auto* allocator = c10::getDeviceAllocator(device_.type());
  allocator->resetPeakStats(device_.index());
  base_ = static_cast<double>(
      allocator->getDeviceStats(device_.index()).allocated_bytes[kAggregate].current);
}

double MemoryMeter::freeBytes() const {
  if (emulation_.emulatesMemory()) {
    return std::max(0.0, emulation_.memoryTotalBytes - emulation_.memoryFixedBytes);
  }
  if (device_.is_cpu()) {
    return -1.0;
  }
  auto* allocator = c10::getDeviceAllocator(device_.type());
  return static_cast<double>(allocator->getMemoryInfo(device_.index()).first);
}

MemoryReading MemoryMeter::endStep(int64_t samples) {
  MemoryReading r;
  r.valid = true;
  if (emulation_.emulatesMemory()) {
    r.emulated = true;
    r.device = true;
    r.baseBytes = emulation_.memoryFixedBytes;
    r.peakBytes = r.baseBytes + emulation_.memoryPerSampleBytes * static_cast<double>(samples);
    r.reservedPeakBytes = r.peakBytes;
    r.totalBytes = emulation_.memoryTotalBytes;
    return r;
  }
  if (device_.is_cpu()) {
    r.residentBytes = residentBytes();
    return r;
  }
  auto* allocator = c10::getDeviceAllocator(device_.type());
  const auto stats = allocator->getDeviceStats(device_.index());
  const auto [freeBytes, totalBytes] = allocator->getMemoryInfo(device_.index());
  r.device = true;
  r.baseBytes = base_;
  r.peakBytes = static_cast<double>(stats.allocated_bytes[kAggregate].peak);
  r.reservedPeakBytes = static_cast<double>(stats.reserved_bytes[kAggregate].peak);
  r.totalBytes = static_cast<double>(totalBytes);
  r.otherBytes = std::max(0.0, static_cast<double>(totalBytes) - static_cast<double>(freeBytes) -
                                   static_cast<double>(stats.reserved_bytes[kAggregate].current));
  return r;
}

}  // namespace train
}  // namespace hddp
