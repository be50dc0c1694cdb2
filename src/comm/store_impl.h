#pragma once

#include <atomic>
#include <memory>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "hddp/comm/store.h"

namespace hddp {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::string description;
  uint16_t port = 0;
  // HDDP_FAULT's drop@store=N: the connection counts as lost from then on (shared with
  // the stores made from it by withPrefix).
  std::shared_ptr<std::atomic<bool>> dropped = std::make_shared<std::atomic<bool>>(false);
};

namespace detail {
inline const c10::intrusive_ptr<c10d::Store>& c10dStore(const Store& store) {
  return store.impl()->store;
}
}  // namespace detail

}  // namespace hddp
