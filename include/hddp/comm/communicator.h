// Collective communication among the ranks of one job.
//
// One interface, two backends chosen at creation: Gloo (CPU tensors; tensors of any
// other device are staged through host memory: CUDA ones by ProcessGroupGloo, others,
// e.g. an emulated accelerator's, by a blocking copy to the host before the collective
// and a copy back when it completes) and NCCL (CUDA tensors, on the current stream). Both are
// LibTorch's own c10d backends, so no second copy of Gloo or NCCL enters the process.
//
// All ranks must issue the same collectives in the same order. Calls return a Work;
// results are valid after Work::wait(). Operations are in place unless stated.
// A communicator is used from one thread at a time.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hddp/comm/store.h"
#include "hddp/comm/wait_observer.h"
#include "hddp/comm/work.h"

namespace hddp {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduceOpName(ReduceOp op) noexcept;

enum class Backend { Gloo, Nccl };
const char* backendName(Backend backend) noexcept;
/// "gloo" / "nccl" (case-insensitive); throws hddp::ConfigError otherwise.
Backend parseBackend(const std::string& text);

/// PyTorch's defaults: 30 minutes for Gloo, 10 minutes for NCCL.
std::chrono::milliseconds defaultTimeout(Backend backend);

struct CommunicatorOptions {
  /// Default: Gloo.
  Backend backend = Backend::Gloo;
  /// Collective and connection timeout. Default 0 = defaultTimeout(backend), or
  /// HDDP_TIMEOUT_SEC when set.
  std::chrono::milliseconds timeout{0};
  /// Gloo: network interface to bind (empty = HDDP_GLOO_INTERFACE, else hostname,
  /// falling back to loopback).
  std::string glooInterface;
  /// Gloo: address to bind when no interface is given (empty = this host's name).
  /// initFromEnv sets 127.0.0.1 when MASTER_ADDR is a loopback address (one node).
  std::string glooHostname;
  /// Gloo worker threads. Default 0 = HDDP_GLOO_THREADS (2).
  int glooThreads = 0;
  /// NCCL: the CUDA device this rank uses. Ignored by Gloo.
  c10::Device device = c10::Device(c10::kCPU);
};

/// What every collective takes (as torchcomms' OptionsBase): a per-call timeout.
struct CollectiveOptions {
  /// This call's timeout; 0 (the default): the communicator's timeout(). A collective
  /// that does not complete in time fails with hddp::TimeoutError or BackendError.
  std::chrono::milliseconds timeout{0};
};

struct AllreduceOptions : CollectiveOptions {
  AllreduceOptions() = default;
  AllreduceOptions(ReduceOp reduceOp) : op(reduceOp) {}  // NOLINT: allreduce(t, {Max})
  ReduceOp op = ReduceOp::Sum;
};

struct BroadcastOptions : CollectiveOptions {
  int root = 0;
};

struct AllgatherOptions : CollectiveOptions {};

struct ReduceOptions : CollectiveOptions {
  int root = 0;
  ReduceOp op = ReduceOp::Sum;
};

struct ReduceScatterOptions : CollectiveOptions {
  ReduceOp op = ReduceOp::Sum;
};

struct BarrierOptions : CollectiveOptions {};

/// Thread safety: collectives may be launched from several threads (launches are
/// serialised per process; every rank must launch the same collectives in the same
/// order); a Work is used by one thread at a time. Ownership: DDP, the Trainer, the
/// planner and SyncBatchNorm keep a reference (GradScaler a pointer) to the
/// communicator, which must outlive them.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
  /// Where this communicator's own tensors live: CPU for Gloo, the rank's CUDA device
  /// for NCCL. Not the device the rank computes on: a GPU rank under Gloo computes on
  /// its GPU (the Trainer takes its device from the model).
  virtual c10::Device device() const = 0;

  /// In-place allreduce of one tensor. Avg on Gloo is a sum divided on wait().
  virtual Work allreduce(at::Tensor& tensor, const AllreduceOptions& options = {}) = 0;
  /// The same through a const handle (`const at::Tensor& t`). at::Tensor is a handle, so
  /// the result lands in the storage it views (the Work keeps that alive until it
  /// completes) and is read through any other handle to it; LibTorch's in-place methods
  /// are const for the same reason.
  Work allreduce(const at::Tensor& tensor, const AllreduceOptions& options = {}) {
    at::Tensor handle = tensor;
    return allreduce(handle, options);
  }
  /// The same through a temporary that views a tensor someone else holds: a view of a
  /// named buffer (`comm.allreduce(flat.narrow(0, 0, n))`, `comm.allreduce(t.view({-1}))`,
  /// `t.detach()`) is reduced in place there. A temporary whose storage no other tensor
  /// sees would take the result with it: `comm.allreduce(x * 2)`, `at::ones(...)`, a
  /// `t.to(...)` or `t.contiguous()` that copied, and, so that these fail alike whether
  /// or not they copied, one that returned `t` itself while nothing else views t's
  /// storage. Those throw hddp::ConfigError before any collective: reduce a named tensor
  /// (`auto y = x.to(dev); comm.allreduce(y);`) or a view of one. `std::move(t)` counts
  /// as such a temporary: pass `t`. A view of a temporary (`at::ones(...).narrow(...)`)
  /// is not told apart from a view of a named tensor. The check looks at each rank's own
  /// argument: a program that passes such a temporary on some ranks only is wrong on
  /// those, and the other ranks' collective waits for them until its timeout.
  Work allreduce(at::Tensor&& tensor, const AllreduceOptions& options = {});
  /// In-place allreduce of several tensors of one dtype and device, coalesced into
  /// one flat buffer (one collective instead of one per tensor).
  virtual Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                                  const AllreduceOptions& options = {}) = 0;
  /// Broadcasts `tensor` from `options.root` into every rank's `tensor` (same
  /// shape/dtype).
  virtual Work broadcast(at::Tensor& tensor, const BroadcastOptions& options) = 0;
  Work broadcast(at::Tensor& tensor, int root = 0) {
    BroadcastOptions o;
    o.root = root;
    return broadcast(tensor, o);
  }
  /// Reduces every rank's `tensor` into `options.root`'s `tensor` (same shape/dtype on
  /// every rank). The other ranks' tensors are left with unspecified contents (the
  /// backends use them as scratch). The default implementation is an allreduce: the
  /// same result on the root for twice the bytes; Gloo and NCCL reduce.
  virtual Work reduce(at::Tensor& tensor, const ReduceOptions& options);
  /// Gathers every rank's `input` into `outputs` (size() tensors of input's shape,
  /// allocated by the caller).
  virtual Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                         const AllgatherOptions& options = {}) = 0;
  /// Reduces `input` (size() * output.numel() elements, rank-major) across ranks and
  /// leaves rank r's slice in `output`.
  virtual Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                             const ReduceScatterOptions& options) = 0;
  Work reduceScatter(at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::Sum) {
    ReduceScatterOptions o;
    o.op = op;
    return reduceScatter(output, input, o);
  }
  virtual Work barrier(const BarrierOptions& options = {}) = 0;

  /// Blocks the host until the results of the collectives already waited on can be
  /// read on the host. Work::wait() on NCCL only orders the device stream after the
  /// collective (the host returns at once; a later host read synchronizes); call this
  /// before host code reads a result, e.g. a CPU tensor under a test double with NCCL's
  /// semantics. Gloo: nothing to do (its wait() blocks). NCCL: waits for the device's
  /// current stream.
  virtual void synchronize() {}

  /// Tells `observer` of every wait() and synchronize() of the Works this communicator
  /// hands out (those already out too), until the returned handle is removed or
  /// destroyed: DDP's buckets, SyncBatchNorm's statistics, a user's own collectives
  /// (hddp/comm/wait_observer.h). The observer must outlive the handle; remove it while
  /// no other thread waits on this communicator's Works.
  [[nodiscard]] virtual RemovableHandle addWaitObserver(WaitObserver& observer);

  /// Gathers a variable-size byte blob from every rank (e.g. measured step times).
  /// Blocking: two collectives (sizes, then padded payloads).
  std::vector<std::vector<uint8_t>> allgatherBytes(const std::vector<uint8_t>& mine);

 protected:
  /// The observers a Work of this communicator tells of its waits (implementations
  /// give it to each Work they make).
  const std::shared_ptr<detail::WaitObservers>& waitObservers() const { return waitObservers_; }

 private:
  std::shared_ptr<detail::WaitObservers> waitObservers_ = std::make_shared<detail::WaitObservers>();
};

/// Creates the communicator of `rank` in a group of `size` ranks meeting at `store`.
/// Blocks until all ranks have joined (or the timeout passes: hddp::TimeoutError).
std::unique_ptr<Communicator> makeCommunicator(const Store& store, int rank, int size,
                                               const CommunicatorOptions& options = {});

/// Whether this build can create NCCL communicators (CUDA sources compiled in).
bool ncclAvailable() noexcept;
/// The NCCL version LibTorch loads ("2.28.9"), or "not built" without CUDA.
std::string ncclVersion();

}  // namespace hddp
