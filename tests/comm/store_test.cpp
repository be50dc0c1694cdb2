#include "hddp/comm/store.h"

#include <gtest/gtest.h>

#include <thread>

#include "hddp/core/error.h"
#include "support/ranks.h"

namespace {

// `other` is a second handle on the same store (its own connection for TCP), used by
// the thread that releases a blocked get.
void exerciseStore(hddp::Store store, hddp::Store other) {
  store.set("alpha", "one");
  EXPECT_EQ(store.getString("alpha"), "one");
  EXPECT_EQ(store.add("counter", 2), 2);
  EXPECT_EQ(store.add("counter", 3), 5);
  EXPECT_TRUE(store.check({"alpha", "counter"}));
  EXPECT_FALSE(store.check({"alpha", "missing"}));
  // A value set later by another thread releases a waiting get.
  std::thread setter([other]() mutable {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    other.set("late", std::vector<uint8_t>{1, 2, 3});
  });
  EXPECT_EQ(store.get("late"), (std::vector<uint8_t>{1, 2, 3}));
  setter.join();
  // Prefixes isolate key spaces.
  auto a = store.withPrefix("a");
  auto b = store.withPrefix("b");
  a.set("k", "from a");
  b.set("k", "from b");
  EXPECT_EQ(a.getString("k"), "from a");
  EXPECT_EQ(b.getString("k"), "from b");
  EXPECT_FALSE(store.check({"k"}));
  EXPECT_TRUE(store.deleteKey("alpha"));
  EXPECT_FALSE(store.check({"alpha"}));
}

TEST(Store, Memory) {
  auto store = hddp::Store::memory();
  exerciseStore(store, store);
}

TEST(Store, File) {
  const std::string dir = hddp::testing::makeTempDir();
  exerciseStore(hddp::Store::file(dir + "/store", 2), hddp::Store::file(dir + "/store", 2));
}

TEST(Store, TcpServerAndClient) {
  hddp::TcpStoreOptions server;
  server.isServer = true;
  server.port = 0;
  auto s = hddp::Store::tcp(server);
  ASSERT_GT(s.port(), 0);
  hddp::TcpStoreOptions client;
  client.port = s.port();
  auto c = hddp::Store::tcp(client);
  c.set("from-client", "hi");
  EXPECT_EQ(s.getString("from-client"), "hi");
  exerciseStore(c, hddp::Store::tcp(client));
  EXPECT_NE(s.description().find(std::to_string(s.port())), std::string::npos);
}

TEST(Store, WaitTimeoutNamesTheKeys) {
  auto store = hddp::Store::memory();
  try {
    store.wait({"never-set"}, std::chrono::milliseconds(200));
    FAIL() << "expected a TimeoutError";
  } catch (const hddp::TimeoutError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("never-set"), std::string::npos) << msg;
  }
}

TEST(Store, ConnectingToNothingFailsWithinTheTimeout) {
  hddp::TcpStoreOptions client;
  client.port = 1;  // nothing listens on port 1
  client.timeout = std::chrono::seconds(2);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(hddp::Store::tcp(client), hddp::DistributedError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

}  // namespace
