#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "hddp/comm/work.h"

namespace hddp {

struct Work::Impl {
  /// Null for work that completed on creation (e.g. an empty tensor list).
  c10::intrusive_ptr<c10d::Work> work;
  /// Runs once after the collective completed (Avg division, unflattening, ...).
  std::function<void()> onComplete;
  std::string description;
  bool finished = false;
};

}  // namespace hddp

namespace hddp {
namespace detail {

/// Runs `fn` (on a backend thread) when `work` completes; at once if it already has.
inline void onCompletion(Work& work, std::function<void()> fn) {
  auto* impl = work.impl();
  if (!impl || !impl->work) {
    fn();
    return;
  }
  impl->work->getFuture()->addCallback([fn = std::move(fn)](c10::ivalue::Future&) { fn(); });
}

}  // namespace detail
}  // namespace hddp
