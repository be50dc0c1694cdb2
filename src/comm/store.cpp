#include "hddp/comm/store.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/errors.h"
#include "comm/loopback.h"
#include "comm/store_impl.h"
#include "hddp/core/error.h"
#include "hddp/core/fault.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

std::string keyList(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) {
    out += (i ? ", '" : "'") + keys[i] + "'";
  }
  if (keys.size() > 4) {
    out += ", ... (" + std::to_string(keys.size()) + " keys)";
  }
  return out;
}

// HDDP_FAULT's store=N point (hddp/core/fault.h): a dropped connection fails this
// operation and every later one on the store.
void faultPoint(Store::Impl& impl, const std::string& what) {
  HDDP_CHECK_AS(StoreError, !impl.dropped->load(), what, " on ", impl.description,
                " failed: the connection to the store dropped (fault injected by HDDP_FAULT)");
  if (fault::beforeStoreOp(what)) {
    impl.dropped->store(true);
    HDDP_THROW(StoreError, what, " on ", impl.description,
               " failed: the connection to the store dropped (fault injected by HDDP_FAULT)");
  }
}

}  // namespace

Store::Store(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {
  HDDP_INTERNAL_ASSERT(impl_ && impl_->store, "Store without an underlying c10d store");
}

Store Store::tcp(const TcpStoreOptions& options) {
  HDDP_CHECK_AS(ConfigError, !options.host.empty(),
                "TcpStoreOptions.host is empty; set it to "
                "the address of rank 0 (MASTER_ADDR)");
  HDDP_CHECK_AS(ConfigError, options.isServer || options.port != 0,
                "TcpStoreOptions.port 0 only works for the server; clients need MASTER_PORT");
  c10d::TCPStoreOptions opts;
  opts.port = options.port;
  opts.isServer = options.isServer;
  if (options.worldSize > 0) {
    opts.numWorkers = static_cast<size_t>(options.worldSize);
  }
  opts.waitWorkers = options.worldSize > 0;
  opts.timeout = options.timeout;
  auto impl = std::make_shared<Impl>();
  const std::string where = options.host + ":" + std::to_string(options.port);
  const bool loopbackOnly = options.isServer && detail::isLoopbackAddress(options.host);
  if (loopbackOnly) {
    // c10d's server listens on every interface; a store its clients reach on loopback
    // needs nothing beyond it. The store takes the socket over.
    opts.masterListenFd = detail::listenOnLoopback(options.port);
  }
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(options.host, opts);
    impl->port = store->getPort();
    impl->store = store;
  } catch (...) {
    detail::rethrowAsDistributed(std::string(options.isServer ? "starting the TCPStore server on "
                                                              : "connecting to the TCPStore at ") +
                                     where,
                                 detail::FailedOperation::Store);
  }
  impl->description = "TCPStore " + options.host + ":" + std::to_string(impl->port);
  if (options.isServer && !loopbackOnly) {
    HDDP_LOG_INFO("comm", "the rendezvous store listens on port ", impl->port,
                  " of every interface (MASTER_ADDR ", options.host,
                  " is not a loopback address); keep multi-node jobs on a private network "
                  "(docs/launching.md)");
  } else {
    HDDP_LOG_DEBUG("comm", options.isServer ? "hosting " : "joined ", impl->description,
                   loopbackOnly ? " (listening on loopback only)" : "");
  }
  return Store(std::move(impl));
}

Store Store::file(const std::string& path, int worldSize, std::chrono::milliseconds timeout) {
  HDDP_CHECK_AS(ConfigError, !path.empty(), "Store::file needs a path");
  HDDP_CHECK_AS(ConfigError, worldSize >= 1, "Store::file: worldSize must be >= 1, got ",
                worldSize);
  auto impl = std::make_shared<Impl>();
  try {
    impl->store = c10::make_intrusive<c10d::FileStore>(path, worldSize);
    impl->store->setTimeout(timeout);
  } catch (...) {
    detail::rethrowAsDistributed("opening the file store " + path, detail::FailedOperation::Store);
  }
  impl->description = "FileStore " + path;
  return Store(std::move(impl));
}

Store Store::memory(std::chrono::milliseconds timeout) {
  auto impl = std::make_shared<Impl>();
  impl->store = c10::make_intrusive<c10d::HashStore>();
  impl->store->setTimeout(timeout);
  impl->description = "in-memory store";
  return Store(std::move(impl));
}

Store Store::withPrefix(const std::string& prefix) const {
  auto impl = std::make_shared<Impl>();
  impl->store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store);
  impl->port = impl_->port;
  impl->description = impl_->description + " prefix '" + prefix + "'";
  impl->dropped = impl_->dropped;
  return Store(std::move(impl));
}

void Store::set(const std::string& key, const std::vector<uint8_t>& value) {
  faultPoint(*impl_, "store set('" + key + "')");
  try {
    impl_->store->set(key, value);
  } catch (...) {
    detail::rethrowAsDistributed("store set('" + key + "') on " + impl_->description,
                                 detail::FailedOperation::Store);
  }
}

void Store::set(const std::string& key, const std::string& value) {
  set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::vector<uint8_t> Store::get(const std::string& key) {
  faultPoint(*impl_, "store get('" + key + "')");
  try {
    return impl_->store->get(key);
  } catch (...) {
    detail::rethrowAsDistributed("store get('" + key + "') on " + impl_->description,
                                 detail::FailedOperation::Store);
  }
}

std::string Store::getString(const std::string& key) {
  auto bytes = get(key);
  return std::string(bytes.begin(), bytes.end());
}

int64_t Store::add(const std::string& key, int64_t delta) {
  faultPoint(*impl_, "store add('" + key + "')");
  try {
    return impl_->store->add(key, delta);
  } catch (...) {
    detail::rethrowAsDistributed("store add('" + key + "') on " + impl_->description,
                                 detail::FailedOperation::Store);
  }
}

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  faultPoint(*impl_, "store wait(" + keyList(keys) + ")");
  try {
    impl_->store->wait(keys, timeout);
  } catch (...) {
    detail::rethrowAsDistributed("store wait(" + keyList(keys) + ") on " + impl_->description,
                                 detail::FailedOperation::Store);
  }
}

void Store::wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

bool Store::check(const std::vector<std::string>& keys) {
  faultPoint(*impl_, "store check(" + keyList(keys) + ")");
  try {
    return impl_->store->check(keys);
  } catch (...) {
    detail::rethrowAsDistributed("store check(" + keyList(keys) + ") on " + impl_->description,
                                 detail::FailedOperation::Store);
  }
}

bool Store::deleteKey(const std::string& key) {
  faultPoint(*impl_, "store delete('" + key + "')");
  try {
    return impl_->store->deleteKey(key);
  } catch (...) {
    detail::rethrowAsDistributed("store delete('" + key + "') on " + impl_->description,
                                 detail::FailedOperation::Store);
  }
}

std::chrono::milliseconds Store::timeout() const { return impl_->store->getTimeout(); }

void Store::setTimeout(std::chrono::milliseconds timeout) { impl_->store->setTimeout(timeout); }

uint16_t Store::port() const { return impl_->port; }

const std::string& Store::description() const { return impl_->description; }

}  // namespace hddp
