// PowerSGD's tests' buckets and steps: a bucket of given shapes, and one step of a hook
// over buckets as DDP runs it (tests/ddp/power_sgd*_test.cpp).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/comm_hooks.h"

namespace hddp {
namespace testing {

// A bucket of gradients of the given shapes, the buffer holding `values`.
inline hddp::GradBucket makeBucket(int index, bool last,
                                   const std::vector<std::vector<int64_t>>& shapes,
                                   const at::Tensor& values) {
  hddp::GradBucket b;
  b.index = index;
  b.isLast = last;
  b.buffer = values.clone();
  int64_t at = 0;
  for (const auto& s : shapes) {
    b.parameters.push_back(at::empty(s, values.options()));
    b.offsets.push_back(at);
    at += b.parameters.back().numel();
  }
  EXPECT_EQ(at, values.numel());
  return b;
}

// One step of a hook over the buckets, as DDP runs it: each bucket's hook in order,
// every first round waited for, then each `then` in order, waited for, then the finishes.
inline void runStep(const hddp::CommHook& hook, hddp::Communicator& comm,
                    std::vector<hddp::GradBucket>& buckets) {
  std::vector<hddp::CommHookResult> first;
  for (auto& b : buckets) {
    first.push_back(hook(comm, b));
  }
  for (auto& r : first) {
    r.work.wait();
  }
  std::vector<hddp::CommHookResult> second(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    if (first[i].then) {
      second[i] = first[i].then();
    }
  }
  for (auto& r : second) {
    r.work.wait();
  }
  for (size_t i = 0; i < first.size(); ++i) {
    if (first[i].finish) {
      first[i].finish();
    }
    if (second[i].finish) {
      second[i].finish();
    }
  }
}

}  // namespace testing
}  // namespace hddp
