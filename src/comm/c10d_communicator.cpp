// The Communicator over a c10d backend (c10d_communicator.h): each collective checked,
// staged through the host where Gloo cannot reach the device, launched under one
// process-wide lock, and returned as a Work that finishes Avg and copies back on wait.
#include "comm/c10d_communicator.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <mutex>

#include "comm/errors.h"
#include "comm/work_impl.h"
#include "hddp/core/error.h"
#include "hddp/core/fault.h"
#include "hddp/core/logging.h"

namespace hddp {

namespace {

c10d::ReduceOp toC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::Avg:
      return c10d::ReduceOp(c10d::ReduceOp::AVG);
    case ReduceOp::Max:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::Min:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  HDDP_INTERNAL_ASSERT(false, "unhandled ReduceOp ", static_cast<int>(op));
}

std::mutex& launchMutex() {
  static std::mutex m;
  return m;
}

std::string describeTensors(const std::vector<at::Tensor>& tensors) {
  int64_t elements = 0;
  for (const auto& t : tensors) {
    elements += t.defined() ? t.numel() : 0;
  }
  std::string dtype = tensors.empty() || !tensors[0].defined()
                          ? "?"
                          : std::string(c10::toString(tensors[0].scalar_type()));
  std::string device = tensors.empty() || !tensors[0].defined() ? "?" : tensors[0].device().str();
  return c10::str(tensors.size(), tensors.size() == 1 ? " tensor, " : " tensors, ", elements,
                  " elements ", dtype, " on ", device);
}

// Communicator over any c10d::Backend (ProcessGroupGloo, ProcessGroupNCCL).
class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(c10::intrusive_ptr<c10d::Backend> backend, Backend kind, int rank, int size,
                   std::chrono::milliseconds timeout, c10::Device device)
      : backend_(std::move(backend)),
        kind_(kind),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        device_(device) {}

  ~C10dCommunicator() override {
    try {
      if (kind_ == Backend::Nccl) {
        backend_->shutdown();
      }
    } catch (const std::exception& e) {
      HDDP_LOG_WARN("comm", "shutting down the ", backendName(kind_), " communicator: ", e.what());
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return kind_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  Work allreduce(at::Tensor& tensor, const AllreduceOptions& options) override {
    checkTensor(tensor, "allreduce");
    if (needsStaging(tensor)) {
      at::Tensor host = toHost(tensor);
      return copiedBackOnCompletion(allreduce(host, options), {host}, {tensor});
    }
    std::vector<at::Tensor> tensors{tensor};
    return reduceInPlace(tensors, options, "allreduce");
  }

  Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                          const AllreduceOptions& options) override {
    if (tensors.empty()) {
      return Work();
    }
    for (const auto& t : tensors) {
      checkTensor(t, "allreduceCoalesced");
      HDDP_CHECK(t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device(),
                 "allreduceCoalesced needs one dtype and device for all tensors; got ",
                 tensors[0].scalar_type(), " on ", tensors[0].device(), " and ", t.scalar_type(),
                 " on ", t.device(), ". Group tensors by dtype and device first.");
    }
    if (tensors.size() == 1) {
      return allreduce(tensors[0], options);
    }
    if (needsStaging(tensors[0])) {
      std::vector<at::Tensor> host;
      for (const auto& t : tensors) {
        host.push_back(toHost(t));
      }
      return copiedBackOnCompletion(allreduceCoalesced(host, options), host, tensors);
    }
    std::vector<at::Tensor> flat_views;
    flat_views.reserve(tensors.size());
    for (const auto& t : tensors) {
      flat_views.push_back(t.reshape({-1}));
    }
    std::vector<at::Tensor> flat{at::cat(flat_views)};
    std::vector<at::Tensor> targets = tensors;
    auto work = reduceInPlace(flat, options, "allreduceCoalesced", describeTensors(tensors));
    // Scatter back into the caller's tensors once the collective has completed.
    auto finishFlat = std::move(work.impl_unsafe()->onComplete);
    work.impl_unsafe()->onComplete = [flat, targets, finishFlat]() mutable {
      if (finishFlat) {
        finishFlat();
      }
      int64_t offset = 0;
      for (auto& t : targets) {
        const int64_t n = t.numel();
        t.copy_(flat[0].narrow(0, offset, n).view(t.sizes()));
        offset += n;
      }
    };
    return std::move(work.work);
  }

  using Communicator::allreduce;
  using Communicator::broadcast;
  using Communicator::reduceScatter;

  Work broadcast(at::Tensor& tensor, const BroadcastOptions& options) override {
    const int root = options.root;
    checkTensor(tensor, "broadcast");
    HDDP_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of this ", size_,
               "-rank group");
    if (needsStaging(tensor)) {
      at::Tensor host = toHost(tensor);
      return copiedBackOnCompletion(broadcast(host, options), {host}, {tensor});
    }
    std::vector<at::Tensor> tensors{tensor};
    const std::string what =
        c10::str("broadcast from rank ", root, " of ", describeTensors(tensors), rankSuffix());
    if (tensor.numel() == 0) {
      return completed(what);
    }
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeoutOf(options);
    return launch(what, [&] { return backend_->broadcast(tensors, opts); });
  }

  Work reduce(at::Tensor& tensor, const ReduceOptions& options) override {
    const int root = options.root;
    checkTensor(tensor, "reduce");
    checkAvg(options.op, tensor);
    HDDP_CHECK(root >= 0 && root < size_, "reduce root ", root, " is not a rank of this ", size_,
               "-rank group");
    if (needsStaging(tensor)) {
      at::Tensor host = toHost(tensor);
      return copiedBackOnCompletion(reduce(host, options), {host}, {tensor});
    }
    std::vector<at::Tensor> tensors{tensor};
    const std::string what = c10::str("reduce(", reduceOpName(options.op), ") to rank ", root,
                                      " of ", describeTensors(tensors), rankSuffix());
    if (tensor.numel() == 0) {
      return completed(what);
    }
    const bool emulateAvg = options.op == ReduceOp::Avg && kind_ == Backend::Gloo;
    c10d::ReduceOptions opts;
    opts.reduceOp = toC10d(emulateAvg ? ReduceOp::Sum : options.op);
    opts.rootRank = root;
    opts.rootTensor = 0;
    opts.timeout = timeoutOf(options);
    auto work = launch(what, [&] { return backend_->reduce(tensors, opts); });
    if (emulateAvg && rank_ == root) {
      at::Tensor t = tensor;
      const int n = size_;
      work.impl_unsafe()->onComplete = [t, n]() mutable { t.div_(n); };
    }
    return std::move(work.work);
  }

  Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                 const AllgatherOptions& options) override {
    checkTensor(input, "allgather");
    HDDP_CHECK(static_cast<int>(outputs.size()) == size_, "allgather needs ", size_,
               " output tensors (one per rank), got ", outputs.size());
    for (const auto& out : outputs) {
      HDDP_CHECK(out.defined() && out.sizes() == input.sizes() &&
                     out.scalar_type() == input.scalar_type() && out.device() == input.device(),
                 "allgather outputs must match the input (", input.sizes(), " ",
                 input.scalar_type(), " on ", input.device(), "), got ",
                 out.defined() ? c10::str(out.sizes(), " ", out.scalar_type(), " on ", out.device())
                               : std::string("an undefined tensor"));
      HDDP_CHECK(out.is_contiguous(), "allgather outputs must be contiguous");
    }
    if (needsStaging(input)) {
      std::vector<at::Tensor> host;
      for (const auto& out : outputs) {
        host.push_back(at::empty(out.sizes(), out.options().device(c10::kCPU)));
      }
      return copiedBackOnCompletion(allgather(host, toHost(input), options), host, outputs);
    }
    const std::string what = c10::str("allgather of ", describeTensors({input}), rankSuffix());
    if (input.numel() == 0) {
      return completed(what);
    }
    std::vector<std::vector<at::Tensor>> outs{outputs};
    std::vector<at::Tensor> ins{input};
    c10d::AllgatherOptions opts;
    opts.timeout = timeoutOf(options);
    return launch(what, [&] { return backend_->allgather(outs, ins, opts); });
  }

  Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                     const ReduceScatterOptions& options) override {
    const ReduceOp op = options.op;
    checkTensor(output, "reduceScatter");
    checkTensor(input, "reduceScatter");
    HDDP_CHECK(input.numel() == output.numel() * size_, "reduceScatter: input has ", input.numel(),
               " elements, expected size() * output.numel() = ", size_, " * ", output.numel());
    HDDP_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(),
               "reduceScatter: input and output must share dtype and device");
    if (needsStaging(output)) {
      at::Tensor host = at::empty(output.sizes(), output.options().device(c10::kCPU));
      return copiedBackOnCompletion(reduceScatter(host, toHost(input), options), {host}, {output});
    }
    const std::string what = c10::str("reduceScatter(", reduceOpName(op), ") of ",
                                      describeTensors({input}), rankSuffix());
    if (output.numel() == 0) {
      return completed(what);
    }
    const bool emulateAvg = op == ReduceOp::Avg && kind_ == Backend::Gloo;
    checkAvg(op, input);
    std::vector<at::Tensor> outs{output};
    std::vector<std::vector<at::Tensor>> ins{input.reshape({size_, -1}).unbind(0)};
    for (auto& t : ins[0]) {
      t = t.view(output.sizes());
    }
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = toC10d(emulateAvg ? ReduceOp::Sum : op);
    opts.timeout = timeoutOf(options);
    auto work = launch(what, [&] { return backend_->reduce_scatter(outs, ins, opts); });
    if (emulateAvg) {
      at::Tensor out = output;
      const int n = size_;
      work.impl_unsafe()->onComplete = [out, n]() mutable { out.div_(n); };
    }
    return std::move(work.work);
  }

  Work barrier(const BarrierOptions& options) override {
    const std::string what = c10::str("barrier", rankSuffix());
    c10d::BarrierOptions opts;
    opts.timeout = timeoutOf(options);
    if (kind_ == Backend::Nccl) {
      opts.device = device_;
    }
    return launch(what, [&] { return backend_->barrier(opts); });
  }

  c10::Device device() const override {
    return kind_ == Backend::Nccl ? device_ : c10::Device(c10::kCPU);
  }

  void synchronize() override {
    if (kind_ == Backend::Nccl) {
      c10::Event done(device_.type());
      done.record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
      done.synchronize();
    }
  }

 private:
  // A Work under construction whose Impl may still be edited.
  struct PendingWork {
    Work work;
    WorkAccess::Impl* impl;
    WorkAccess::Impl* impl_unsafe() { return impl; }
    operator Work() && { return std::move(work); }  // NOLINT: implicit by design
  };

  std::string rankSuffix() const { return c10::str(" on rank ", rank_, "/", size_); }

  // A call's own timeout, else the communicator's.
  std::chrono::milliseconds timeoutOf(const CollectiveOptions& options) const {
    HDDP_CHECK(options.timeout.count() >= 0, "a collective's timeout must be >= 0 (0: the ",
               "communicator's), got ", options.timeout.count(), " ms");
    return options.timeout.count() > 0 ? options.timeout : timeout_;
  }

  // Gloo reduces host memory, and CUDA tensors, which ProcessGroupGloo stages itself.
  // Tensors of any other device (a PrivateUse1 accelerator such as hddp::emu) are staged
  // here: copied to the host before the collective (a blocking copy, so the device's
  // work on them has finished) and back into the caller's tensors once it completed, in
  // wait() or synchronize(), after the Avg division.
  bool needsStaging(const at::Tensor& t) const {
    return kind_ == Backend::Gloo && !t.is_cpu() && !t.is_cuda();
  }
  static at::Tensor toHost(const at::Tensor& t) { return t.to(c10::kCPU).contiguous(); }
  static Work copiedBackOnCompletion(Work work, std::vector<at::Tensor> host,
                                     std::vector<at::Tensor> targets) {
    WorkAccess::Impl* impl = WorkAccess::impl(work);
    auto before = std::move(impl->onComplete);
    impl->onComplete = [before, host, targets]() mutable {
      if (before) {
        before();
      }
      for (size_t i = 0; i < targets.size(); ++i) {
        targets[i].copy_(host[i]);
      }
    };
    return work;
  }

  void checkTensor(const at::Tensor& t, const char* op) const {
    HDDP_CHECK(t.defined(), op, ": the tensor is undefined");
    HDDP_CHECK(t.is_contiguous(), op, ": the tensor must be contiguous (got strides ", t.strides(),
               "); call .contiguous() first");
    HDDP_CHECK(!t.is_sparse(), op, ": sparse tensors are not supported");
    if (kind_ == Backend::Nccl) {
      HDDP_CHECK(t.is_cuda(), op, " on the NCCL backend needs CUDA tensors, got one on ",
                 t.device(), "; use a Gloo communicator for CPU tensors");
    } else {
      HDDP_CHECK(!t.is_meta(), op, " on Gloo needs tensors with data, got one on ", t.device());
    }
  }

  void checkAvg(ReduceOp op, const at::Tensor& t) const {
    HDDP_CHECK(op != ReduceOp::Avg || at::isFloatingType(t.scalar_type()),
               "ReduceOp::Avg needs a floating-point tensor, got ", t.scalar_type(),
               "; use Sum and divide yourself");
  }

  Work completed(const std::string& what) {
    auto impl = std::make_unique<WorkAccess::Impl>();
    impl->description = what;
    impl->waitObservers = waitObservers();
    return WorkAccess::make(std::move(impl));
  }

  template <typename Launch>
  PendingWork launch(const std::string& what, Launch&& fn) {
    fault::beforeCollective(rank_, what);  // HDDP_FAULT's collective=N (hddp/core/fault.h)
    auto impl = std::make_unique<WorkAccess::Impl>();
    impl->description = what;
    impl->waitObservers = waitObservers();
    try {
      // c10d's FlightRecorder (torch 2.11) updates a process-wide map before taking its
      // own lock when a collective is enqueued; launches from several communicators on
      // several threads crash in it. Launching is only enqueueing (microseconds), so
      // serialising it per process costs nothing measurable; the collectives still run
      // concurrently.
      std::lock_guard<std::mutex> lock(launchMutex());
      impl->work = fn();
    } catch (...) {
      detail::rethrowAsDistributed(what, detail::FailedOperation::Backend);
    }
    impl->synchronizeWaits = kind_ == Backend::Gloo;
    WorkAccess::Impl* raw = impl.get();
    return PendingWork{WorkAccess::make(std::move(impl)), raw};
  }

  PendingWork reduceInPlace(std::vector<at::Tensor>& tensors, const AllreduceOptions& options,
                            const char* name, const std::string& shown = "") {
    const ReduceOp op = options.op;
    checkAvg(op, tensors[0]);
    const std::string what =
        c10::str(name, "(", reduceOpName(op), ") of ",
                 shown.empty() ? describeTensors(tensors) : shown, rankSuffix());
    if (tensors[0].numel() == 0) {
      auto impl = std::make_unique<WorkAccess::Impl>();
      impl->description = what;
      WorkAccess::Impl* raw = impl.get();
      return PendingWork{WorkAccess::make(std::move(impl)), raw};
    }
    const bool emulateAvg = op == ReduceOp::Avg && kind_ == Backend::Gloo;
    c10d::AllreduceOptions opts;
    opts.reduceOp = toC10d(emulateAvg ? ReduceOp::Sum : op);
    opts.timeout = timeoutOf(options);
    auto pending = launch(what, [&] { return backend_->allreduce(tensors, opts); });
    if (emulateAvg) {
      at::Tensor t = tensors[0];
      const int n = size_;
      pending.impl->onComplete = [t, n]() mutable { t.div_(n); };
    }
    return pending;
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  Backend kind_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
};

}  // namespace

namespace detail {

std::unique_ptr<Communicator> makeC10dCommunicator(c10::intrusive_ptr<c10d::Backend> backend,
                                                   Backend kind, int rank, int size,
                                                   std::chrono::milliseconds timeout,
                                                   c10::Device device) {
  return std::make_unique<C10dCommunicator>(std::move(backend), kind, rank, size, timeout, device);
}

}  // namespace detail
}  // namespace hddp
