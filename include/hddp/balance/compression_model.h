// What gradient compression saves on a link and what it costs, and the choice
// `--compress auto` makes from it (docs/balance.md, "Choosing the compression").
//
//   wire bytes    none: the gradients' bytes; fp16 / bf16: half; PowerSGD: per gradient
//                 viewed as rows x (the rest), rank r = min(rows, cols, R): (rows + cols)
//                 x r elements of P and Q in the wire type when that is at least
//                 minCompressionRate times fewer than rows x cols, else the gradient
//                 whole (a 1-D tensor is rows x 1: whole unless the rate is under 1), as the hooks
//                 decide
//   messages      one allreduce per bucket; PowerSGD two (the whole gradients with P,
//                 then Q; three when P travels in another type) and DDP's one-element
//                 status allreduce after the last bucket
//   allreduce     the ring over the slowest link: 2 (n-1)/n x wire bytes / B
//                 + 2 (n-1) x latency per message (hddp/comm/link_emulation.h)
//   compute       PowerSGD's own arithmetic: per compressed rows x cols matrix,
//                 P = M Q, Q = M^T P, M' = P Q^T (2 rows cols r FLOPs each) and the
//                 orthogonalisation (2 rows r^2), and about eight passes over M in device
//                 memory (error feedback in, the approximation out); the Trainer times it
//                 on the rank's device, what-if models it from the device table
//   exposed       max(allreduce - backward, allreduce x (last bucket's share + the
//                 share sent after backward)) + compute: buckets go out during
//                 backward, the last (the first layers') cannot hide, PowerSGD's Q round
//                 starts only when every bucket's first round is done, and the
//                 compression runs in line with backward
//
// The choice among none, fp16 (bf16 under bf16 AMP), PowerSGD rank 4 and rank 1, in that
// order of fidelity: the first that hides its allreduce (exposes, compute included, at
// most 5% of the step's compute: the last bucket of a plain allreduce often shows more);
// where none does, the one that exposes least, or a more faithful one within 5% of the
// step's compute of it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hddp/amp/amp_mode.h"

namespace hddp {

/// Share of a training step's compute that is backward (buckets go out during it).
constexpr double kBackwardShare = 2.0 / 3.0;

/// What DDP sends for the gradients (the trainers' --compress).
struct CompressionSpec {
  enum class Kind { None, Fp16, Bf16, PowerSgd };
  Kind kind = Kind::None;
  /// PowerSGD: the approximation rank R and the rate under which a gradient goes whole.
  int rank = 1;
  double minCompressionRate = 2.0;
  /// PowerSGD: bytes per element of P and Q on the wire (4 float, 2 fp16 / bf16).
  int factorBytes = 4;

  /// "none", "fp16", "bf16", "powersgd:R".
  std::string name() const;
  /// Parses "none", "fp16", "bf16", "powersgd" (rank 1) or "powersgd:R" (R >= 1);
  /// ConfigError naming `what` otherwise. "auto" is not a spec (see chooseCompression).
  static CompressionSpec parse(const std::string& text, const std::string& what = "--compress");
};

/// The gradients DDP reduces each step: one shape per parameter that has one, in the
/// parameters' order.
struct GradientLayout {
  std::vector<std::vector<int64_t>> shapes;
  int elementBytes = 4;
  /// DDP's bucket caps (DdpOptions::firstBucketBytes, bucketCapBytes).
  double firstBucketBytes = 1 << 20;
  double bucketCapBytes = 25 << 20;

  double bytes() const;
  /// Buckets DDP makes of them (reverse parameter order: the first bucket up to
  /// firstBucketBytes, the others up to bucketCapBytes).
  int buckets() const;
  /// The share of the bytes in the last bucket to go out (the first layers').
  double lastBucketShare() const;
};

/// The link the gradients cross and the backward they can hide behind.
struct LinkBudget {
  int ranks = 1;
  /// The slowest rank's link, bytes/s; 0 = none known (no link term).
  double bytesPerSecond = 0.0;
  double latencySeconds = 0.0;
  /// Backward seconds of the step's slowest rank (kBackwardShare of its compute).
  double backwardSeconds = 0.0;
};

/// One choice priced.
struct CompressionCost {
  CompressionSpec spec;
  double wireBytes = 0.0;    // what each rank's allreduces carry per step
  int messages = 0;          // allreduces per step
  double flops = 0.0;        // the compression's own arithmetic (PowerSGD)
  double memoryBytes = 0.0;  // its device-memory traffic
  /// The share of the wire bytes sent only once backward is over: PowerSGD's Q round,
  /// which starts when every bucket's first round is done.
  double endShare = 0.0;
  double allreduceSeconds = 0.0;
  double computeSeconds = 0.0;
  double exposedSeconds = 0.0;  // allreduce not hidden by backward, plus compute
  /// It exposes little: exposesLittle(exposedSeconds, backward).
  bool hidden = false;

  /// "powersgd:4: 0.41 MB in 5 allreduces, 82 ms over the link, 3.1 ms compute, 12 ms
  /// exposed".
  std::string describe() const;
};

/// The bytes, messages and arithmetic of `spec` for `layout`; the times are 0 until
/// priced. ConfigError when PowerSGD is asked for without shapes.
CompressionCost compressionTraffic(const CompressionSpec& spec, const GradientLayout& layout);

/// `cost` with its allreduce over `link` and its exposed time, `computeSeconds` being
/// the compression's own (measured or modelled).
CompressionCost priceCompression(CompressionCost cost, const GradientLayout& layout,
                                 const LinkBudget& link, double computeSeconds);

/// The part of an allreduce of `allreduce` seconds that backward (`backward` seconds)
/// does not hide: max(allreduce - backward, allreduce x (lastShare + endShare)), the
/// last bucket's share and the part sent after backward being out once backward ends.
double exposedAllreduceSeconds(double allreduce, double backward, double lastShare,
                               double endShare);

/// Whether `exposedSeconds` is little enough to count as hidden: at most 5% of the
/// step's compute (backwardSeconds / kBackwardShare).
bool exposesLittle(double exposedSeconds, double backwardSeconds);

/// `--compress auto`'s candidates in order of fidelity: none, fp16 (bf16 under bf16
/// AMP), powersgd:4, powersgd:1.
std::vector<CompressionSpec> autoCandidates(AmpMode amp);

struct CompressionDecision {
  CompressionCost chosen;
  std::vector<CompressionCost> candidates;  // as priced, in order of fidelity
  /// One line: what was compared and why the choice won.
  std::string why;
};

/// The choice (see the header comment) among `priced` (in order of fidelity, priced
/// against `link`). ConfigError when `priced` is empty.
CompressionDecision chooseCompression(const std::vector<CompressionCost>& priced,
                                      const LinkBudget& link);

}  // namespace hddp
