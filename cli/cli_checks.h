// CLI11 range checks with messages a user can read: CLI11's PositiveNumber and
// NonNegativeNumber print their bounds as 300-digit numbers ("--lr -1" said the value
// must be in [2.2e-308 - 1.8e308] written out in full).
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <limits>
#include <string>

namespace hddp {
namespace cli {

/// A finite number above `low` (or at least `low` when `inclusive`), optionally at most
/// `high`; the message names the bound in a few digits.
inline CLI::Validator numberAtLeast(double low, bool inclusive,
                                    double high = std::numeric_limits<double>::infinity()) {
  const std::string bound = (inclusive ? ">= " : "> ") + CLI::detail::to_string(low) +
                            (std::isinf(high) ? "" : " and <= " + CLI::detail::to_string(high));
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v)) {
          return "'" + text + "' is not a finite number";
        }
        if (inclusive ? v < low : v <= low) {
          return "must be " + bound + ", got " + text;
        }
        if (v > high) {
          return "must be " + bound + ", got " + text;
        }
        return std::string();
      },
      inclusive ? (low == 0 ? "NONNEGATIVE" : "NUMBER " + bound) : "POSITIVE");
}

/// > 0 (replaces CLI::PositiveNumber).
inline CLI::Validator positive() { return numberAtLeast(0, false); }
/// >= 0 (replaces CLI::NonNegativeNumber).
inline CLI::Validator nonNegative() { return numberAtLeast(0, true); }

}  // namespace cli
}  // namespace hddp
