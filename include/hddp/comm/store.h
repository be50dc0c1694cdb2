// Rendezvous key-value store: how ranks find each other and exchange small metadata.
//
// A thin value type over LibTorch's c10d stores (TCPStore, FileStore, HashStore,
// PrefixStore), so hddp and LibTorch code can share one store. Copies share the same
// underlying store (and, for TCP, the same connection). Calls are thread-safe, but a
// TCP connection serves one call at a time: a thread blocked in get()/wait() holds it,
// so a thread that must make progress meanwhile needs its own Store::tcp() client.
//
// Every blocking call takes its timeout from the store (`timeout()`, default 5 min,
// or the one given at creation) unless one is passed. Failures throw hddp::StoreError;
// a wait that runs out throws hddp::TimeoutError naming the keys.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hddp {

struct TcpStoreOptions {
  /// Host of the server (MASTER_ADDR). Default: loopback.
  std::string host = "127.0.0.1";
  /// Port of the server (MASTER_PORT). 0 with `isServer` binds a free port (see port()).
  uint16_t port = 29500;
  /// This process hosts the server (rank 0 in torchrun's non-agent mode).
  bool isServer = false;
  /// Number of processes that will connect, server included; 0 = do not wait for them.
  int worldSize = 0;
  /// Connect/wait timeout. Default: 5 minutes, as c10d's store default.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
};

class Store {
 public:
  /// TCP store (client or server) on c10d::TCPStore.
  static Store tcp(const TcpStoreOptions& options);
  /// Store in a file shared by all ranks (c10d::FileStore); `worldSize` ranks use it.
  static Store file(const std::string& path, int worldSize,
                    std::chrono::milliseconds timeout = std::chrono::minutes(5));
  /// In-process store for threads of one process (c10d::HashStore).
  static Store memory(std::chrono::milliseconds timeout = std::chrono::minutes(5));

  /// A view of this store in which every key is prefixed with `prefix` + "/".
  Store withPrefix(const std::string& prefix) const;

  void set(const std::string& key, const std::vector<uint8_t>& value);
  void set(const std::string& key, const std::string& value);
  /// Blocks until `key` exists (up to the store timeout), then returns its value.
  std::vector<uint8_t> get(const std::string& key);
  std::string getString(const std::string& key);
  /// Atomically adds `delta` to the integer at `key` (created as 0); returns the result.
  int64_t add(const std::string& key, int64_t delta);
  /// Blocks until all `keys` exist; throws hddp::TimeoutError after `timeout`.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  void wait(const std::vector<std::string>& keys);
  /// True when all `keys` exist. Never blocks beyond one round trip.
  bool check(const std::vector<std::string>& keys);
  bool deleteKey(const std::string& key);

  std::chrono::milliseconds timeout() const;
  void setTimeout(std::chrono::milliseconds timeout);

  /// The TCP port of a server store (useful with port 0); 0 for other stores.
  uint16_t port() const;
  /// A short description for messages, e.g. "TCPStore 127.0.0.1:29500".
  const std::string& description() const;

  struct Impl;
  explicit Store(std::shared_ptr<Impl> impl);
  const std::shared_ptr<Impl>& impl() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace hddp
