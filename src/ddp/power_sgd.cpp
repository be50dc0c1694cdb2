// PowerSGD as a DDP communication hook (hddp/ddp/power_sgd.h): PyTorch's powerSGD_hook
// in C++, in two rounds of DDP's hook contract. The first round (at the bucket's
// launch, overlapping backward) sends the uncompressed gradients and P = M Q; the
// second (after every bucket's first round) orthogonalises P, sends Q = M^T P, and the
// finish decompresses M = P Q^T and keeps the error.
#include "hddp/ddp/power_sgd.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <random>

#include "ddp/power_sgd_math.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

using detail::orthogonalize;

namespace {

// One gradient of a bucket that is compressed: its matrix view (1 x rows x cols) and
// its P and Q views (1 x rows x r, 1 x cols x r) into the bucket's memories.
struct Factorised {
  at::Tensor matrix;
  at::Tensor p;
  at::Tensor q;
  size_t gradient = 0;  // its position in the bucket
};

// The key of a bucket's gradient in the memories: the parameter's name, or for a
// bucket made by hand (no names) its bucket and position.
std::vector<std::string> memoryKeys(const GradBucket& bucket) {
  if (!bucket.names.empty()) {
    HDDP_CHECK(bucket.names.size() == bucket.parameters.size(), "GradBucket ", bucket.index, ": ",
               bucket.names.size(), " names for ", bucket.parameters.size(), " parameters");
    return bucket.names;
  }
  std::vector<std::string> keys;
  for (size_t i = 0; i < bucket.parameters.size(); ++i) {
    keys.push_back(std::to_string(bucket.index) + "." + std::to_string(i));
  }
  return keys;
}

// The seed of the random starting Q of draw number `draw` (0, 1, ...): the draw-th
// output of mt19937_64(seed), the same on every rank. The engine is kept per thread
// where the last draw left it, so a run drawing in sequence (no warm start: every step)
// pays O(1) a draw; another seed or another count (a resume, an undone step, a second
// state drawing in between) starts it again and discards up to the count, O(draw) once.
uint64_t drawSeed(uint64_t seed, int64_t draw) {
  struct Engine {
    bool started = false;
    uint64_t seed = 0;
    int64_t next = 0;  // the draw the engine's next output is
    std::mt19937_64 engine;
  };
  thread_local Engine e;
  if (!e.started || e.seed != seed || e.next != draw) {
    e.engine.seed(seed);
    e.engine.discard(static_cast<unsigned long long>(draw));
    e.seed = seed;
    e.started = true;
  }
  e.next = draw + 1;
  return e.engine();
}

}  // namespace

// The parts of a PowerSgdState a bucket's work reads and writes.
struct PowerSgdMemories {
  const PowerSgdOptions* options;
  int64_t* step;
  int64_t* draws;
  int64_t* before;
  int64_t* after;
  std::map<std::string, at::Tensor>* error;
  std::map<std::string, at::Tensor>* q;
  bool* stepFinite;  // false once a bucket of this step reduced to inf/NaN
};

struct PowerSgdAccess {
  static CommHookResult hook(const std::shared_ptr<PowerSgdState>& state, Communicator& comm,
                             GradBucket& bucket);
  static void undoMemories(PowerSgdState& state) { state.undoMemories(); }
};

namespace {

// The hook's work for one bucket at one compressed step.
class CompressedBucket : public std::enable_shared_from_this<CompressedBucket> {
 public:
  CompressedBucket(std::shared_ptr<PowerSgdState> state, PowerSgdMemories memories,
                   Communicator& comm, const GradBucket& bucket)
      : state_(std::move(state)),
        m_(memories),
        comm_(comm),
        index_(bucket.index),
        isLast_(bucket.isLast),
        input_(bucket.buffer),
        offsets_(bucket.offsets),
        keys_(memoryKeys(bucket)) {
    gradients_ = bucket.gradients();
  }

  // The first round; where it throws (out of memory on the autograd thread), the state
  // is left as it was, so DDP may send the bucket again.
  CommHookResult firstRound() {
    const int64_t draws = *m_.draws;
    const int64_t before = *m_.before;
    const int64_t after = *m_.after;
    try {
      return firstRoundOrThrow();
    } catch (...) {
      if (addedError_.defined()) {
        input_.sub_(addedError_);
      }
      *m_.draws = draws;
      *m_.before = before;
      *m_.after = after;
      throw;
    }
  }

 private:
  CommHookResult firstRoundOrThrow() {
    const PowerSgdOptions& o = *m_.options;
    int64_t* before = m_.before;
    int64_t* after = m_.after;
    int64_t* draws = m_.draws;
    std::map<std::string, at::Tensor>& error = *m_.error;
    std::map<std::string, at::Tensor>& qs = *m_.q;
    const auto options = input_.options();
    if (o.errorFeedback) {
      // Each parameter's memory at its gradient's place in the bucket (none yet: zero).
      at::Tensor memory;
      for (size_t i = 0; i < gradients_.size(); ++i) {
        auto known = error.find(keys_[i]);
        if (known == error.end()) {
          continue;
        }
        const int64_t n = gradients_[i].numel();
        if (known->second.numel() != n) {
          HDDP_LOG_INFO("ddp", "PowerSGD: ", keys_[i], "'s error memory holds ",
                        known->second.numel(), " elements, its gradient ", n, ": dropped");
          error.erase(known);
          continue;
        }
        if (!memory.defined()) {
          memory = at::zeros({input_.numel()}, options);
        }
        memory.narrow(0, offsets_[i], n).copy_(known->second.reshape({-1}));
      }
      if (memory.defined()) {
        input_.add_(memory);
        addedError_ = memory;
      }
      inputCopy_ = input_.clone();
    }
    // Which gradients are worth compressing; the rest go whole in one allreduce.
    std::vector<at::Tensor> whole;
    std::vector<std::pair<at::Tensor, size_t>> matrices;  // with the gradient's position
    int64_t totalP = 0;
    int64_t totalQ = 0;
    for (size_t i = 0; i < gradients_.size(); ++i) {
      const at::Tensor& g = gradients_[i];
      if (g.dim() == 0 || g.numel() == 0) {
        whole.push_back(g);
        *before += g.numel();
        *after += g.numel();
        continue;
      }
      at::Tensor m = g.view({g.size(0), -1});
      const int64_t rows = m.size(0);
      const int64_t cols = m.size(1);
      const int64_t r = std::min<int64_t>({rows, cols, o.rank});
      const int64_t uncompressed = rows * cols;
      const int64_t compressed = (rows + cols) * r;
      *before += uncompressed;
      if (static_cast<double>(compressed) * o.minCompressionRate <
          static_cast<double>(uncompressed)) {
        matrices.emplace_back(m, i);
        totalP += rows * r;
        totalQ += cols * r;
        *after += compressed;
      } else {
        whole.push_back(g);
        *after += uncompressed;
      }
    }
    whole_ = whole;
    wholeWire_ = whole.empty() ? at::empty({0}, options) : at::cat(flatViews(whole));

    // PyTorch's order: gradients grouped by shape, groups in order of first appearance.
    std::vector<std::vector<std::pair<at::Tensor, size_t>>> groups;
    for (const auto& m : matrices) {
      bool placed = false;
      for (auto& g : groups) {
        if (g.front().first.sizes() == m.first.sizes()) {
          g.push_back(m);
          placed = true;
          break;
        }
      }
      if (!placed) {
        groups.push_back({m});
      }
    }
    pMemory_ = at::empty({totalP}, options);
    qMemory_ = at::empty({totalQ}, options);
    int64_t pAt = 0;
    int64_t qAt = 0;
    for (const auto& g : groups) {
      for (const auto& m : g) {
        const int64_t rows = m.first.size(0);
        const int64_t cols = m.first.size(1);
        const int64_t r = std::min<int64_t>({rows, cols, o.rank});
        factors_.push_back(
            Factorised{m.first.unsqueeze(0), pMemory_.narrow(0, pAt, rows * r).view({1, rows, r}),
                       qMemory_.narrow(0, qAt, cols * r).view({1, cols, r}), m.second});
        pAt += rows * r;
        qAt += cols * r;
      }
    }
    // Warm start from every factor's last Q (copied: the stored memory stays as it was
    // until the step's end); drawn afresh for the whole bucket where one has none.
    bool randomize = !o.warmStart;
    for (const auto& f : factors_) {
      if (randomize) {
        break;
      }
      auto known = qs.find(keys_[f.gradient]);
      if (known != qs.end() && known->second.numel() != f.q.numel()) {
        HDDP_LOG_INFO("ddp", "PowerSGD: ", keys_[f.gradient], "'s Q memory holds ",
                      known->second.numel(), " elements, its factor needs ", f.q.numel(),
                      ": drawn afresh");
        qs.erase(known);
        known = qs.end();
      }
      randomize = known == qs.end();
    }
    if (!randomize) {
      for (auto& f : factors_) {
        f.q.copy_(qs.at(keys_[f.gradient]).reshape(f.q.sizes()));
        orthogonalize(f.q, o.orthogonalizationEpsilon);
      }
    } else if (!factors_.empty()) {
      // The same on every rank: a seed drawn from the options' seed and the draw count.
      const uint64_t seed = drawSeed(o.randomSeed, *draws);
      ++*draws;
      auto generator = at::make_generator<at::CPUGeneratorImpl>(seed % 1000000000ULL);
      for (auto& f : factors_) {
        f.q.copy_(at::randn(f.q.sizes(), generator, at::TensorOptions().dtype(options.dtype())));
        orthogonalize(f.q, o.orthogonalizationEpsilon);
      }
    }
    for (auto& f : factors_) {
      at::bmm_out(f.p, f.matrix, f.q);
    }
    // One collective where the types allow: the whole gradients and P together.
    wire_ = o.wireType == c10::ScalarType::Undefined ? options.dtype().toScalarType() : o.wireType;
    std::vector<at::Tensor> first;
    if (wholeWire_.numel() > 0) {
      first.push_back(wholeWire_);
    }
    if (pMemory_.numel() > 0) {
      pWire_ = wire_ == pMemory_.scalar_type() ? pMemory_ : pMemory_.to(wire_);
      first.push_back(pWire_);
    }
    Work work;
    if (first.size() == 2 && first[0].scalar_type() == first[1].scalar_type()) {
      work = comm_.allreduceCoalesced(first);
    } else if (first.size() == 2) {
      // Different types: two collectives, the second's Work carried by the first's. Once
      // the first is sent the bucket cannot be sent again: DDP re-sends a bucket whose
      // hook ran out of memory (an abandoned step), and this rank would then have sent
      // one collective more than its peers. Such an error ends the step unrepeatable.
      Work a = comm_.allreduce(first[0]);
      try {
        second_ = std::make_shared<Work>(comm_.allreduce(first[1]));
      } catch (const c10::OutOfMemoryError& e) {
        HDDP_THROW(DistributedError, "PowerSGD: bucket ", index_, " ran out of memory issuing ",
                   "its P after its uncompressed gradients were sent (", e.what_without_backtrace(),
                   "); the step cannot be repeated, as the ",
                   "ranks' collectives would no longer match. Leave more memory free, or ",
                   "send P and Q in the gradients' type (PowerSgdOptions::wireType left ",
                   "Undefined: one collective)");
      }
      work = std::move(a);
    } else if (first.size() == 1) {
      work = comm_.allreduce(first[0]);
    }
    auto self = shared_from_this();
    CommHookResult result;
    result.work = std::move(work);
    result.then = [self]() { return self->secondRound(); };
    return result;
  }

  static std::vector<at::Tensor> flatViews(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> out;
    for (const auto& t : tensors) {
      out.push_back(t.reshape({-1}));
    }
    return out;
  }

  CommHookResult secondRound() {
    if (second_) {
      second_->wait();
      second_.reset();
    }
    int64_t at = 0;
    for (auto& t : whole_) {
      t.copy_(wholeWire_.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
    const PowerSgdOptions& o = *m_.options;
    if (pWire_.defined() && pWire_.data_ptr() != pMemory_.data_ptr()) {
      pMemory_.copy_(pWire_);
    }
    for (auto& f : factors_) {
      orthogonalize(f.p, o.orthogonalizationEpsilon);
    }
    for (auto& f : factors_) {
      at::bmm_out(f.q, f.matrix.transpose(1, 2), f.p);
    }
    CommHookResult result;
    if (qMemory_.numel() > 0) {
      qWire_ = wire_ == qMemory_.scalar_type() ? qMemory_ : qMemory_.to(wire_);
      result.work = comm_.allreduce(qWire_);
    }
    auto self = shared_from_this();
    result.finish = [self]() { self->decompress(); };
    return result;
  }

  void decompress() {
    const PowerSgdOptions& o = *m_.options;
    if (qWire_.defined() && qWire_.data_ptr() != qMemory_.data_ptr()) {
      qMemory_.copy_(qWire_);
    }
    for (auto& f : factors_) {
      at::bmm_out(f.matrix, f.p, f.q.transpose(1, 2));
    }
    const bool finite = input_.numel() == 0 || at::isfinite(input_).all().item<bool>();
    if (!finite) {
      // A float16 overflow (the GradScaler skips this step): the whole step's changes to
      // the memories are undone at its last bucket, those of buckets before this one too.
      HDDP_LOG_INFO("ddp", "PowerSGD: bucket ", index_,
                    "'s reduced gradient is not finite; the step leaves the memories as they "
                    "were");
      *m_.stepFinite = false;
    } else {
      if (o.errorFeedback) {
        // Weighted units: this rank's input less its 1/n part of the reduced sum, kept
        // per parameter (views of one new tensor, never written in place).
        const at::Tensor left = inputCopy_ - input_ / static_cast<double>(comm_.size());
        for (size_t i = 0; i < gradients_.size(); ++i) {
          (*m_.error)[keys_[i]] = left.narrow(0, offsets_[i], gradients_[i].numel());
        }
      }
      // A Q with an all-zero column (a gradient that was all zero: an unused layer)
      // would keep P and Q zero from then on: drawn afresh instead. Q is the same on every
      // rank after its allreduce, so every rank decides alike.
      std::vector<at::Tensor> zeroColumns;  // one host read for the bucket, not per tensor
      for (const auto& f : factors_) {
        zeroColumns.push_back((at::linalg_vector_norm(f.q, 2, at::IntArrayRef{1}) == 0).any());
      }
      const bool zeroColumn = !zeroColumns.empty() && at::stack(zeroColumns).any().item<bool>();
      for (const auto& f : factors_) {
        if (o.warmStart && !zeroColumn) {
          (*m_.q)[keys_[f.gradient]] = f.q.reshape({-1});
        } else {
          m_.q->erase(keys_[f.gradient]);
        }
      }
    }
    if (isLast_) {
      if (!*m_.stepFinite) {
        PowerSgdAccess::undoMemories(
            *state_);  // the step counts (as PyTorch's iter), its memories do not
      }
      ++*m_.step;
    }
  }

  std::shared_ptr<PowerSgdState> state_;  // keeps the memories alive
  PowerSgdMemories m_;
  Communicator& comm_;
  int index_;
  bool isLast_;
  at::Tensor input_;
  std::vector<int64_t> offsets_;
  std::vector<std::string> keys_;  // each gradient's key in the memories
  at::Tensor inputCopy_;
  at::Tensor addedError_;  // the error memory added into the input (undone on a throw)
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> whole_;
  at::Tensor wholeWire_;
  std::vector<Factorised> factors_;
  at::Tensor pMemory_;
  at::Tensor qMemory_;
  at::Tensor pWire_;
  at::Tensor qWire_;
  c10::ScalarType wire_ = at::kFloat;
  std::shared_ptr<Work> second_;
};

}  // namespace

CommHookResult PowerSgdAccess::hook(const std::shared_ptr<PowerSgdState>& state, Communicator& comm,
                                    GradBucket& bucket) {
  PowerSgdState& s = *state;
  if (!s.undo_.open || s.undo_.lastSeen) {
    s.beginStep();  // the step's first bucket: what discardStep() restores
  }
  if (s.step_ < s.options_.startStep) {
    Work work = comm.allreduce(bucket.buffer);
    if (bucket.isLast) {  // counted once sent: a hook that threw may be called again
      ++s.step_;
      s.undo_.lastSeen = true;  // the next bucket handed over starts another step
    }
    return CommHookResult{std::move(work), nullptr, nullptr};
  }
  if (!s.startLogged_) {
    s.startLogged_ = true;
    HDDP_LOG_SHARED("ddp", comm.rank(), "PowerSGD starts at step ", s.step_, " (rank ",
                    s.options_.rank, ", P and Q sent as ",
                    s.options_.wireType == c10::ScalarType::Undefined
                        ? std::string("the gradients' type")
                        : std::string(c10::toString(s.options_.wireType)),
                    ")");
  }
  PowerSgdMemories memories{&s.options_,       &s.step_,  &s.draws_, &s.elementsBefore_,
                            &s.elementsAfter_, &s.error_, &s.q_,     &s.undo_.finite};
  auto work = std::make_shared<CompressedBucket>(state, memories, comm, bucket);
  CommHookResult result = work->firstRound();  // a throw leaves the state as it was
  if (bucket.isLast) {
    s.undo_.lastSeen = true;  // the next bucket handed over starts another step
  }
  return result;
}

CommHook powerSgdHook(std::shared_ptr<PowerSgdState> state) {
  HDDP_CHECK_AS(ConfigError, state != nullptr, "powerSgdHook: the state is a null pointer");
  return [state](Communicator& comm, GradBucket& bucket) {
    return PowerSgdAccess::hook(state, comm, bucket);
  };
}

CommHook powerSgdHook(PowerSgdOptions options) {
  return powerSgdHook(std::make_shared<PowerSgdState>(options));
}

}  // namespace hddp
