// See third_party/gloo_decls/README.md: the v1 interface of gloo::rendezvous::Store.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace gloo {
namespace rendezvous {

class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::seconds(30);

  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) = 0;
};

}  // namespace rendezvous
}  // namespace gloo
