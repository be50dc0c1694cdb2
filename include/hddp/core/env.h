// The one registry of environment variables hddp reads.
//
// Each variable has a name, a type, a default, a one-line description and optional
// legacy aliases (older or foreign names that mean the same thing, e.g. PyTorch's
// GLOO_SOCKET_IFNAME). Precedence everywhere: explicit option > environment > default.
// `describe()` / `dump()` print the values in force and who set them.
//
// Launcher conventions (RANK, WORLD_SIZE, SLURM_*, OMPI_COMM_WORLD_*) are read by the
// comm layer's rendezvous, not registered here: they are other programs' variables.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hddp {
namespace env {

enum class Type { Bool, Int, Float, String };

struct Variable {
  std::string name;
  Type type;
  std::string defaultValue;
  std::string description;
  std::vector<std::string> aliases;
};

/// Every variable hddp reads, in a stable order.
const std::vector<Variable>& registry();

/// The registered variable `name` (not an alias); throws hddp::Error if unknown.
const Variable& variable(const std::string& name);

enum class Source { Explicit, Environment, Default };
const char* sourceName(Source source) noexcept;

/// A value together with where it came from. `setBy` names the option or the
/// environment variable (possibly an alias) that supplied it.
template <typename T>
struct Resolved {
  T value;
  Source source;
  std::string setBy;
};

/// The raw text of `name` from the environment (checking its aliases in order), or
/// nullopt. `setBy` receives the variable actually found.
std::optional<std::string> lookup(const std::string& name, std::string* setBy = nullptr);

// Typed resolution with precedence explicit > environment > default. Values that do
// not parse throw hddp::ConfigError naming the variable, the value and the type.
Resolved<bool> resolveBool(const std::string& name, std::optional<bool> explicitValue = {});
Resolved<int64_t> resolveInt(const std::string& name, std::optional<int64_t> explicitValue = {});
Resolved<double> resolveFloat(const std::string& name, std::optional<double> explicitValue = {});
Resolved<std::string> resolveString(const std::string& name,
                                    std::optional<std::string> explicitValue = {});

inline bool getBool(const std::string& name) { return resolveBool(name).value; }
inline int64_t getInt(const std::string& name) { return resolveInt(name).value; }
inline double getFloat(const std::string& name) { return resolveFloat(name).value; }

/// The longest HDDP_TIMEOUT_SEC taken: a year (more would overflow the milliseconds).
constexpr int64_t kMaxTimeoutSeconds = 365LL * 24 * 3600;
/// HDDP_TIMEOUT_SEC (0 = unset: the backend's default); ConfigError when negative or
/// above kMaxTimeoutSeconds.
std::chrono::seconds timeoutFromEnv();
inline std::string getString(const std::string& name) { return resolveString(name).value; }

// Parsers shared with other environment readers (launcher variables).
bool parseBool(const std::string& name, const std::string& text);
int64_t parseInt(const std::string& name, const std::string& text);
double parseFloat(const std::string& name, const std::string& text);

struct Setting {
  std::string name;
  std::string value;
  Source source;
  std::string setBy;
  std::string description;
};

/// The value in force of every registered variable.
std::vector<Setting> describe();

/// `describe()` as an aligned table, one variable per line.
std::string dump();

}  // namespace env
}  // namespace hddp
