#pragma once

// Shared by the emu tests: installs emu (2 devices) once and puts it back in its default
// state around every test, so that tests do not leak slowdowns, delays or violations.

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <hddp/emu/emu.h>
#include <torch/torch.h>

#include <string>

namespace hddp {
namespace emu {
namespace testing {

inline EmuOptions defaultOptions() {
  EmuOptions o;
  o.deviceCount = 2;
  return o;
}

inline c10::Device emuDevice(int index) {
  return {c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index)};
}

inline c10::impl::VirtualGuardImpl& guardImpl() {
  static c10::impl::VirtualGuardImpl impl(c10::DeviceType::PrivateUse1);
  return impl;
}

/// A side stream of emu:`index` that no other test uses.
inline c10::Stream newSideStream(int index) { return guardImpl().getNewStream(emuDevice(index)); }

inline c10::Stream defaultStream(int index) {
  return guardImpl().getDefaultStream(emuDevice(index));
}

class EmuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    install(defaultOptions());
    clearViolations();
    resetCounters();
  }
  void TearDown() override {
    for (int i = 0; i < deviceCount(); ++i) {
      guardImpl().synchronizeDevice(static_cast<c10::DeviceIndex>(i));
    }
    EXPECT_TRUE(violations().empty())
        << "unexpected stream-safety violations: " << violations().size()
        << (violations().empty() ? "" : "; first: " + violations()[0]);
    clearViolations();
  }
};

/// Whether `f` throws a c10::Error whose message contains `text`.
template <class F>
::testing::AssertionResult throwsWith(F&& f, const std::string& text) {
  try {
    f();
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    if (message.find(text) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "threw, but without '" << text << "': " << message;
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace testing
}  // namespace emu
}  // namespace hddp
