#include "emu/ordering.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_set>

namespace hddp {
namespace emu {
namespace detail {
namespace {

struct StreamLog {
  uint64_t issued = 0;
  Clock clock;
};

struct Use {
  c10::Stream stream;
  uint64_t lastUse = 0;
  uint64_t lastRead = 0;  // 0: never read
};

struct Block {
  size_t bytes = 0;
  c10::Stream allocationStream;
  std::optional<c10::Stream> writer;
  uint64_t writeSeq = 0;
  std::unordered_map<uint64_t, Use> uses;
  std::unordered_set<uint64_t> recorded;
};

// All logical state, behind one mutex. Leaked: deleters may run during exit.
struct State {
  std::mutex mutex;
  std::unordered_map<uint64_t, StreamLog> streams;
  std::unordered_map<uint64_t, c10::Stream> streamOf;
  Clock host;
  std::unordered_map<const void*, Block> blocks;
  std::vector<std::string> violations;
  size_t reported = 0;

  StreamLog& log(c10::Stream s) {
    const uint64_t key = streamKey(s);
    streamOf.emplace(key, s);
    return streams[key];
  }
};

State& state() {
  static auto* s = new State;
  return *s;
}

std::string describeTensor(const at::Tensor& t) {
  std::ostringstream out;
  out << "a tensor on " << t.device() << " (" << t.scalar_type() << " " << t.sizes() << ")";
  return out.str();
}

const void* baseOf(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_privateuseone()) {
    return nullptr;
  }
  return t.storage().data_ptr().get();
}

}  // namespace

uint64_t Clock::at(uint64_t stream) const {
  const auto it = seen_.find(stream);
  return it == seen_.end() ? 0 : it->second;
}

void Clock::raise(uint64_t stream, uint64_t seq) {
  auto& v = seen_[stream];
  v = std::max(v, seq);
}

void Clock::merge(const Clock& other) {
  for (const auto& [stream, seq] : other.seen_) {
    raise(stream, seq);
  }
}

uint64_t streamKey(c10::Stream stream) {
  return (static_cast<uint64_t>(static_cast<uint16_t>(stream.device_index())) << 48) |
         (static_cast<uint64_t>(stream.id()) & ((uint64_t{1} << 48) - 1));
}

std::string describeStream(c10::Stream stream) {
  std::ostringstream out;
  out << "emu:" << static_cast<int>(stream.device_index());
  if (stream.id() == 0) {
    out << " default stream";
  } else {
    out << " side stream " << stream.id();
  }
  return out.str();
}

uint64_t issue(c10::Stream stream, std::initializer_list<Access> accesses, const char* op) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.reported < s.violations.size()) {
    std::string pending = s.violations[s.reported];
    s.reported = s.violations.size();
    TORCH_CHECK(false, pending);
  }
  const uint64_t self = streamKey(stream);
  StreamLog& log = s.log(stream);
  log.clock.merge(s.host);
  for (const Access& a : accesses) {
    const auto it = s.blocks.find(baseOf(*a.tensor));
    if (it == s.blocks.end()) {
      continue;
    }
    const Block& b = it->second;
    if (b.writer && streamKey(*b.writer) != self &&
        log.clock.at(streamKey(*b.writer)) < b.writeSeq) {
      TORCH_CHECK(false, "hddp::emu: ", op, " on ", describeStream(stream), " ",
                  a.write ? "overwrites " : "reads ", describeTensor(*a.tensor), " that ",
                  describeStream(*b.writer), " may still be writing (its work #", b.writeSeq,
                  "; this stream is ordered only up to #", log.clock.at(streamKey(*b.writer)),
                  " of it). Wait on an event recorded after the copy (c10::Event::block) "
                  "before using it, or synchronize that stream.");
    }
    if (!a.write) {
      continue;
    }
    for (const auto& [key, use] : b.uses) {
      if (key != self && use.lastRead > log.clock.at(key)) {
        TORCH_CHECK(false, "hddp::emu: ", op, " on ", describeStream(stream), " overwrites ",
                    describeTensor(*a.tensor), " that ", describeStream(use.stream),
                    " may still be reading (its work #", use.lastRead,
                    "). Make this stream wait on an event recorded after that read "
                    "(c10::Event::block) before writing it.");
      }
    }
  }
  const uint64_t seq = ++log.issued;
  log.clock.raise(self, seq);
  for (const Access& a : accesses) {
    const auto it = s.blocks.find(baseOf(*a.tensor));
    if (it == s.blocks.end()) {
      continue;
    }
    Block& b = it->second;
    auto [u, inserted] = b.uses.try_emplace(self, Use{stream});
    u->second.lastUse = seq;
    if (a.write) {
      b.writer = stream;
      b.writeSeq = seq;
    } else {
      u->second.lastRead = seq;
    }
  }
  return seq;
}

Clock snapshot(c10::Stream stream) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  StreamLog& log = s.log(stream);
  log.clock.merge(s.host);
  return log.clock;
}

void streamWaits(c10::Stream stream, const Clock& clock) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  StreamLog& log = s.log(stream);
  log.clock.merge(s.host);
  log.clock.merge(clock);
}

void hostWaits(const Clock& clock) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.host.merge(clock);
}

void hostSyncStream(c10::Stream stream) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.host.merge(s.log(stream).clock);
}

void hostSyncDevice(c10::DeviceIndex device) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const auto& [key, log] : s.streams) {
    if (s.streamOf.at(key).device_index() == device) {
      s.host.merge(log.clock);
    }
  }
}

void onAllocate(const void* base, size_t bytes, c10::Stream allocationStream) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  Block b{bytes, allocationStream, std::nullopt, 0, {}, {}};
  s.blocks.insert_or_assign(base, std::move(b));
}

void onFree(const void* base) noexcept {
  try {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.blocks.find(base);
    if (it == s.blocks.end()) {
      return;
    }
    const Block& b = it->second;
    const uint64_t owner = streamKey(b.allocationStream);
    const Clock& ownerClock = s.log(b.allocationStream).clock;
    for (const auto& [key, use] : b.uses) {
      if (key == owner || b.recorded.count(key) != 0 || ownerClock.at(key) >= use.lastUse ||
          s.host.at(key) >= use.lastUse) {
        continue;
      }
      std::ostringstream out;
      out << "hddp::emu: a block of " << b.bytes << " bytes allocated on "
          << describeStream(b.allocationStream) << " was freed while " << describeStream(use.stream)
          << " may still use it (its work #" << use.lastUse
          << "), without record_stream: its memory could be reused under that stream's work. "
          << "Call tensor.record_stream(stream) (or c10::impl::VirtualGuardImpl::"
          << "recordDataPtrOnStream) for every other stream that used it, or make the "
          << "allocation stream wait for that stream before the tensor is freed.";
      std::fprintf(stderr, "%s\n", out.str().c_str());
      s.violations.push_back(out.str());
    }
    s.blocks.erase(it);
  } catch (...) {
    std::fprintf(stderr, "hddp::emu: bookkeeping failed while freeing a block\n");
  }
}

void recordStream(const void* base, c10::Stream stream) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = s.blocks.find(base);
  if (it != s.blocks.end()) {
    it->second.recorded.insert(streamKey(stream));
  }
}

void addViolation(const std::string& text) {
  std::fprintf(stderr, "%s\n", text.c_str());
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.violations.push_back(text);
}

std::vector<std::string> storedViolations() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.violations;
}

void clearStoredViolations() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.violations.clear();
  s.reported = 0;
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
