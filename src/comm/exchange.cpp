// The non-template part of hddp/comm/exchange.h: agreements, reductions of a few numbers,
// a root's bytes, and every rank's outcome as a fixed record.
#include "hddp/comm/exchange.h"

#include <ATen/ATen.h>

#include <new>

namespace hddp {

bool agreeAll(Communicator& comm, bool mine) {
  for (const uint8_t said : allgatherValue<uint8_t>(comm, mine ? 1 : 0)) {
    if (said == 0) {
      return false;
    }
  }
  return true;
}

bool agreeAny(Communicator& comm, bool mine) { return !agreeAll(comm, !mine); }

std::vector<double> reduceValues(Communicator& comm, const std::vector<double>& values,
                                 ReduceOp op) {
  HDDP_CHECK(!values.empty(), "reduceValues: no values to reduce");
  at::Tensor t = at::tensor(values, at::kDouble);
  if (comm.device() != t.device()) {
    t = t.to(comm.device());
  }
  comm.allreduce(t, {op}).wait();
  comm.synchronize();  // the host reads it next (Communicator::synchronize)
  t = t.cpu().contiguous();
  const double* data = t.data_ptr<double>();
  return std::vector<double>(data, data + values.size());
}

std::string broadcastBytes(Communicator& comm, int root, const std::string& payload) {
  HDDP_CHECK(root >= 0 && root < comm.size(), "broadcastBytes: root ", root,
             " is not a rank of this communicator of ", comm.size());
  const c10::Device dev = comm.device();
  at::Tensor length =
      at::full({1}, static_cast<int64_t>(payload.size()), at::TensorOptions().dtype(at::kLong))
          .to(dev);
  comm.broadcast(length, root).wait();
  comm.synchronize();
  const int64_t n = length.cpu().item<int64_t>();
  HDDP_CHECK(n >= 0, "broadcastBytes: rank ", root, " announced ", n, " bytes");
  at::Tensor bytes = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  if (comm.rank() == root && n > 0) {
    std::memcpy(bytes.data_ptr<uint8_t>(), payload.data(), payload.size());
  }
  bytes = bytes.to(dev);
  comm.broadcast(bytes, root).wait();
  comm.synchronize();
  if (comm.rank() == root) {
    return payload;
  }
  const at::Tensor host = bytes.cpu();
  return std::string(reinterpret_cast<const char*>(host.data_ptr<uint8_t>()),
                     static_cast<size_t>(n));
}

RankOutcome currentFailure() {
  RankOutcome out;
  try {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    out = {FailureKind::OutOfMemory, e.what_without_backtrace()};
  } catch (const c10::AcceleratorError& e) {
    out = {FailureKind::Device, e.what_without_backtrace()};
  } catch (const ConfigError& e) {
    out = {FailureKind::Config, e.what_without_backtrace()};
  } catch (const DataError& e) {
    out = {FailureKind::Data, e.what_without_backtrace()};
  } catch (const StateError& e) {
    out = {FailureKind::State, e.what_without_backtrace()};
  } catch (const DistributedError& e) {
    out = {FailureKind::Distributed, e.what_without_backtrace()};
  } catch (const Error& e) {
    out = {FailureKind::Error, e.what_without_backtrace()};
  } catch (const c10::Error& e) {
    // LibTorch's CPU allocator reports a failed allocation as a plain c10::Error (its
    // enforce in alloc_cpu.cpp), not as an OutOfMemoryError: it is out of memory too,
    // never the fault of the input being read (a state file is read on the host).
    const std::string what = e.what_without_backtrace();
    out = {what.find("DefaultCPUAllocator: can't allocate memory") != std::string::npos
               ? FailureKind::OutOfMemory
               : FailureKind::Foreign,
           what};
  } catch (const std::bad_alloc& e) {
    out = {FailureKind::OutOfMemory, e.what()};
  } catch (const std::exception& e) {
    out = {FailureKind::Foreign, e.what()};
  } catch (...) {
    out = {FailureKind::Foreign, "an unknown error"};
  }
  return out;
}

void rethrowIfOutOfMemory() {
  if (currentFailure().failure == FailureKind::OutOfMemory) {
    throw;
  }
}

void throwAs(FailureKind kind, const std::string& message) {
  HDDP_INTERNAL_ASSERT(kind != FailureKind::None, "throwAs: no failure to throw (", message, ")");
  switch (kind) {
    case FailureKind::Config:
      HDDP_THROW(ConfigError, message);
    case FailureKind::Data:
      HDDP_THROW(DataError, message);
    case FailureKind::State:
      HDDP_THROW(StateError, message);
    case FailureKind::Distributed:
      HDDP_THROW(DistributedError, message);
    default:
      HDDP_THROW(Error, message);
  }
}

namespace {

constexpr uint8_t kLastKind = static_cast<uint8_t>(FailureKind::Foreign);

}  // namespace

namespace detail {

std::vector<uint8_t> packResult(const RankOutcome& outcome, const void* value, size_t size) {
  std::vector<uint8_t> bytes(1 + size + outcome.message.size());
  bytes[0] = static_cast<uint8_t>(outcome.failure);
  if (size > 0) {
    std::memcpy(bytes.data() + 1, value, size);
  }
  std::memcpy(bytes.data() + 1 + size, outcome.message.data(), outcome.message.size());
  return bytes;
}

RankOutcome unpackResult(const std::vector<uint8_t>& bytes, int rank, void* value, size_t size) {
  HDDP_CHECK(bytes.size() >= 1 + size && bytes[0] <= kLastKind, "rank ", rank,
             " sent an outcome of ", bytes.size(), " bytes",
             bytes.empty() ? std::string() : c10::str(" of kind ", static_cast<int>(bytes[0])),
             " where at least ", 1 + size, " of a kind up to ", static_cast<int>(kLastKind),
             " were expected; every rank must run the same hddp build");
  if (size > 0) {
    std::memcpy(value, bytes.data() + 1, size);
  }
  RankOutcome out;
  out.failure = static_cast<FailureKind>(bytes[0]);
  out.message.assign(bytes.begin() + static_cast<std::ptrdiff_t>(1 + size), bytes.end());
  return out;
}

}  // namespace detail

std::vector<RankOutcome> allgatherOutcomes(Communicator& comm, const RankOutcome& mine) {
  // Nothing for a success without a message (so that a step where every rank succeeded is
  // one collective); else the kind and the message.
  std::vector<uint8_t> said;
  if (mine.failed() || !mine.message.empty()) {
    said = detail::packResult(mine, nullptr, 0);
  }
  const auto all = comm.allgatherBytes(said);
  std::vector<RankOutcome> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      out[r] = detail::unpackResult(all[r], static_cast<int>(r), nullptr, 0);
    }
  }
  return out;
}

}  // namespace hddp
