#include "hddp/core/env.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>

#include "hddp/core/error.h"
#include "support/scoped_env.h"

namespace {

using hddp::testing::ScopedEnv;

TEST(Env, PrecedenceExplicitOverEnvironmentOverDefault) {
  ScopedEnv clear("HDDP_GLOO_THREADS", nullptr);
  auto def = hddp::env::resolveInt("HDDP_GLOO_THREADS");
  EXPECT_EQ(def.value, 2);
  EXPECT_EQ(def.source, hddp::env::Source::Default);

  ScopedEnv set("HDDP_GLOO_THREADS", "6");
  auto fromEnv = hddp::env::resolveInt("HDDP_GLOO_THREADS");
  EXPECT_EQ(fromEnv.value, 6);
  EXPECT_EQ(fromEnv.source, hddp::env::Source::Environment);
  EXPECT_EQ(fromEnv.setBy, "HDDP_GLOO_THREADS");

  auto explicitWins = hddp::env::resolveInt("HDDP_GLOO_THREADS", 3);
  EXPECT_EQ(explicitWins.value, 3);
  EXPECT_EQ(explicitWins.source, hddp::env::Source::Explicit);
}

TEST(Env, LegacyAliasIsReadButCanonicalNameWins) {
  ScopedEnv clear("HDDP_GLOO_INTERFACE", nullptr);
  ScopedEnv alias("GLOO_SOCKET_IFNAME", "lo");
  auto viaAlias = hddp::env::resolveString("HDDP_GLOO_INTERFACE");
  EXPECT_EQ(viaAlias.value, "lo");
  EXPECT_EQ(viaAlias.setBy, "GLOO_SOCKET_IFNAME");

  ScopedEnv canonical("HDDP_GLOO_INTERFACE", "eth0");
  auto both = hddp::env::resolveString("HDDP_GLOO_INTERFACE");
  EXPECT_EQ(both.value, "eth0");
  EXPECT_EQ(both.setBy, "HDDP_GLOO_INTERFACE");
}

TEST(Env, BadValuesNameTheVariableAndTheValue) {
  ScopedEnv bad("HDDP_TIMEOUT_SEC", "ten");
  try {
    hddp::env::getInt("HDDP_TIMEOUT_SEC");
    FAIL() << "expected a ConfigError";
  } catch (const hddp::ConfigError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("HDDP_TIMEOUT_SEC='ten' is not an integer"), std::string::npos) << msg;
  }
  ScopedEnv badBool("HDDP_ALLOW_SHARED_DEVICE", "perhaps");
  EXPECT_THROW(hddp::env::getBool("HDDP_ALLOW_SHARED_DEVICE"), hddp::ConfigError);
}

// Numbers that overflowed (milliseconds of a huge timeout, a 30-digit count) or that
// would sleep forever (inf, nan) are ConfigErrors that name the variable.
TEST(Env, OutOfRangeNumbersAreConfigErrorsNamingTheVariable) {
  auto errorOf = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const hddp::ConfigError& e) {
      return e.what_without_backtrace();
    }
    return "(no ConfigError)";
  };
  {
    ScopedEnv huge("HDDP_TIMEOUT_SEC", "9223372036854775");  // x1000 overflows int64
    const std::string m = errorOf([] { hddp::env::timeoutFromEnv(); });
    EXPECT_NE(m.find("HDDP_TIMEOUT_SEC=9223372036854775 is out of range"), std::string::npos) << m;
  }
  {
    ScopedEnv digits("HDDP_TIMEOUT_SEC", "123456789012345678901234567890");
    const std::string m = errorOf([] { hddp::env::timeoutFromEnv(); });
    EXPECT_NE(m.find("HDDP_TIMEOUT_SEC"), std::string::npos) << m;
    EXPECT_NE(m.find("out of range"), std::string::npos) << m;
  }
  {
    ScopedEnv fine("HDDP_TIMEOUT_SEC", "90");
    EXPECT_EQ(hddp::env::timeoutFromEnv(), std::chrono::seconds(90));
  }
  for (const char* bad : {"inf", "nan", "-inf"}) {
    const std::string m = errorOf([&] { hddp::env::parseFloat("HDDP_X", bad); });
    EXPECT_NE(m.find("HDDP_X='" + std::string(bad) + "' is not a finite number"), std::string::npos)
        << m;
  }
}

TEST(Env, BoolSpellings) {
  for (const char* yes : {"1", "true", "TRUE", "yes", "on", " On "}) {
    EXPECT_TRUE(hddp::env::parseBool("X", yes)) << yes;
  }
  for (const char* no : {"0", "false", "no", "off", ""}) {
    EXPECT_FALSE(hddp::env::parseBool("X", no)) << no;
  }
}

TEST(Env, UnknownVariableIsAnError) {
  EXPECT_THROW(hddp::env::resolveInt("HDDP_NO_SUCH_THING"), hddp::Error);
}

TEST(Env, DumpShowsValueAndWhoSetIt) {
  ScopedEnv set("HDDP_GLOO_THREADS", "5");
  ScopedEnv clear("HDDP_BACKEND", nullptr);
  const std::string text = hddp::env::dump();
  EXPECT_NE(text.find("HDDP_GLOO_THREADS"), std::string::npos);
  EXPECT_NE(text.find("'5'"), std::string::npos) << text;
  EXPECT_NE(text.find("from HDDP_GLOO_THREADS"), std::string::npos) << text;
  // Every registered variable is listed.
  for (const auto& var : hddp::env::registry()) {
    EXPECT_NE(text.find(var.name), std::string::npos) << var.name;
  }
  for (const auto& s : hddp::env::describe()) {
    if (s.name == "HDDP_BACKEND") {
      EXPECT_EQ(s.source, hddp::env::Source::Default);
      EXPECT_EQ(s.value, "auto");
    }
  }
}

}  // namespace
