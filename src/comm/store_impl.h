#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "hddp/comm/store.h"

namespace hddp {

struct Store::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  std::string description;
  uint16_t port = 0;
};

namespace detail {
inline const c10::intrusive_ptr<c10d::Store>& c10dStore(const Store& store) {
  return store.impl()->store;
}
}  // namespace detail

}  // namespace hddp
