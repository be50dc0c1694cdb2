// What every Communicator shares (hddp/comm/communicator.h): the names of reduce ops and
// backends, the base class's convenience collectives (allreduce of a temporary, reduce,
// allgatherBytes) and wait observers, and makeCommunicator, which creates a c10d backend
// and wraps it (c10d_communicator.h).
#include "hddp/comm/communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>

#include "comm/backends.h"
#include "comm/c10d_communicator.h"
#include "comm/errors.h"
#include "comm/store_impl.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

const char* reduceOpName(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

const char* backendName(Backend backend) noexcept {
  return backend == Backend::Nccl ? "nccl" : "gloo";
}

Backend parseBackend(const std::string& text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "gloo") {
    return Backend::Gloo;
  }
  if (lower == "nccl") {
    return Backend::Nccl;
  }
  HDDP_THROW(ConfigError, "unknown backend '", text, "'; use gloo or nccl");
}

std::chrono::milliseconds defaultTimeout(Backend backend) {
  return backend == Backend::Nccl ? std::chrono::minutes(10) : std::chrono::minutes(30);
}

Work Communicator::allreduce(at::Tensor&& tensor, const AllreduceOptions& options) {
  // Decided from this rank's argument alone, before any collective, so that every rank
  // passing the same kind of argument throws alike. A view shares its storage with the
  // tensor it views; a fresh result or copy is the only one to see its own.
  if (tensor.defined() && tensor.has_storage()) {
    HDDP_CHECK_AS(ConfigError, tensor.storage().use_count() > 1,
                  "allreduce of a temporary whose storage no other tensor sees (", tensor.sizes(),
                  " ", tensor.scalar_type(), " on ", tensor.device(),
                  "): the result would be lost with it (e.g. x * 2, at::ones(...), a "
                  ".to()/.contiguous() of a tensor nothing else views). Reduce a named "
                  "tensor (auto y = x.to(dev); comm.allreduce(y);) or a view of one "
                  "(buffer.narrow(...)); for std::move(t), pass t");
  }
  at::Tensor& handle = tensor;
  return allreduce(handle, options);
}

Work Communicator::reduce(at::Tensor& tensor, const ReduceOptions& options) {
  AllreduceOptions all(options.op);
  all.timeout = options.timeout;
  return allreduce(tensor, all);
}

RemovableHandle Communicator::addWaitObserver(WaitObserver& observer) {
  waitObservers_->add(&observer);
  std::weak_ptr<detail::WaitObservers> registry = waitObservers_;
  WaitObserver* registered = &observer;
  return RemovableHandle([registry, registered] {
    if (auto observers = registry.lock()) {
      observers->remove(registered);
    }
  });
}

std::vector<std::vector<uint8_t>> Communicator::allgatherBytes(const std::vector<uint8_t>& mine) {
  const c10::Device dev = device();
  const auto longOpts = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor mySize = at::full({1}, static_cast<int64_t>(mine.size()), longOpts);
  std::vector<at::Tensor> sizes;
  for (int r = 0; r < size(); ++r) {
    sizes.push_back(at::empty({1}, longOpts));
  }
  allgather(sizes, mySize).wait();
  int64_t maxSize = 0;
  std::vector<int64_t> lengths;
  for (const auto& s : sizes) {
    lengths.push_back(s.item<int64_t>());
    maxSize = std::max(maxSize, lengths.back());
  }
  std::vector<std::vector<uint8_t>> result(size());
  if (maxSize == 0) {
    return result;
  }
  const auto byteOpts = at::TensorOptions().dtype(at::kByte);
  at::Tensor padded = at::zeros({maxSize}, byteOpts);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<uint8_t>());
  padded = padded.to(dev);
  std::vector<at::Tensor> gathered;
  for (int r = 0; r < size(); ++r) {
    gathered.push_back(at::empty({maxSize}, byteOpts.device(dev)));
  }
  allgather(gathered, padded).wait();
  for (int r = 0; r < size(); ++r) {
    at::Tensor host = gathered[r].cpu();
    const uint8_t* p = host.data_ptr<uint8_t>();
    result[r].assign(p, p + lengths[r]);
  }
  return result;
}

std::unique_ptr<Communicator> makeCommunicator(const Store& store, int rank, int size,
                                               const CommunicatorOptions& options) {
  HDDP_CHECK_AS(ConfigError, size >= 1, "communicator size must be >= 1, got ", size);
  HDDP_CHECK_AS(ConfigError, rank >= 0 && rank < size, "rank ", rank,
                " is outside the group of size ", size, " (valid: 0..", size - 1, ")");
  std::chrono::milliseconds timeout = options.timeout;
  if (timeout.count() <= 0) {
    const std::chrono::seconds seconds = env::timeoutFromEnv();
    timeout =
        seconds.count() > 0 ? std::chrono::milliseconds(seconds) : defaultTimeout(options.backend);
  }
  // Each communicator gets its own key space in the store, so several communicators
  // (and restarts) in one job do not see each other's keys.
  const int64_t generation =
      store.impl()->store->add("hddp/communicator_generation/" + std::to_string(rank), 1);
  Store scoped = store.withPrefix("hddp/comm/" + std::to_string(generation));
  const auto& c10dStore = detail::c10dStore(scoped);
  c10::intrusive_ptr<c10d::Backend> backend;
  const std::string what =
      c10::str("creating the ", backendName(options.backend), " communicator for rank ", rank, "/",
               size, " via ", store.description());
  try {
    backend = options.backend == Backend::Nccl
                  ? detail::createNcclBackend(c10dStore, rank, size, timeout, options)
                  : detail::createGlooBackend(c10dStore, rank, size, timeout, options);
  } catch (...) {
    detail::rethrowAsDistributed(what, detail::FailedOperation::Backend);
  }
  HDDP_LOG_SHARED("comm", rank, "joined a ", size, "-rank ", backendName(options.backend),
                  " group as rank ", rank, " (timeout ", timeout.count() / 1000, " s)");
  return detail::makeC10dCommunicator(std::move(backend), options.backend, rank, size, timeout,
                                      options.device);
}

}  // namespace hddp
