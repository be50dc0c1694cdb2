#include "hddp/balance/compression_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "hddp/comm/link_emulation.h"
#include "hddp/core/error.h"

namespace hddp {

namespace {

std::string format(const char* pattern, double a, double b = 0, double c = 0, double d = 0) {
  char line[160];
  std::snprintf(line, sizeof line, pattern, a, b, c, d);
  return line;
}

double numelOf(const std::vector<int64_t>& shape) {
  double n = 1.0;
  for (int64_t s : shape) {
    n *= static_cast<double>(s);
  }
  return n;
}

// Parameter indices of each bucket, in launch order (DDP's assignBuckets on the
// parameters in reverse order: the gradients backward makes first).
std::vector<std::vector<size_t>> bucketsOf(const GradientLayout& layout) {
  std::vector<std::vector<size_t>> buckets;
  double bytes = 0.0;
  bool open = false;
  int filled = 0;
  for (size_t k = layout.shapes.size(); k-- > 0;) {
    const double limit = filled == 0 ? layout.firstBucketBytes : layout.bucketCapBytes;
    if (!open) {
      buckets.emplace_back();
      open = true;
    }
    buckets.back().push_back(k);
    bytes += numelOf(layout.shapes[k]) * layout.elementBytes;
    if (bytes >= limit) {
      open = false;
      bytes = 0.0;
      ++filled;
    }
  }
  return buckets;
}

// What one gradient puts on the wire under PowerSGD: elements sent whole, elements of
// P and Q, and the arithmetic and memory traffic of compressing it.
struct TensorWire {
  double whole = 0.0;
  double factors = 0.0;  // P and Q
  double q = 0.0;        // of which Q
  double flops = 0.0;
  double memory = 0.0;
};

TensorWire powerSgdWire(const std::vector<int64_t>& shape, const CompressionSpec& spec,
                        int elementBytes) {
  TensorWire w;
  const double n = numelOf(shape);
  if (shape.empty() || n == 0) {
    w.whole = n;
    return w;
  }
  const double rows = static_cast<double>(shape[0]);
  const double cols = rows > 0 ? n / rows : 0.0;
  const double r = std::min({rows, cols, static_cast<double>(spec.rank)});
  const double compressed = (rows + cols) * r;
  if (compressed * spec.minCompressionRate < n) {
    w.factors = compressed;
    w.q = cols * r;
    w.flops = 3.0 * 2.0 * rows * cols * r + 2.0 * rows * r * r;
    w.memory = 8.0 * n * elementBytes;
  } else {
    w.whole = n;
  }
  return w;
}

}  // namespace

std::string CompressionSpec::name() const {
  switch (kind) {
    case Kind::None:
      return "none";
    case Kind::Fp16:
      return "fp16";
    case Kind::Bf16:
      return "bf16";
    case Kind::PowerSgd:
      return "powersgd:" + std::to_string(rank);
  }
  return "?";
}

CompressionSpec CompressionSpec::parse(const std::string& text, const std::string& what) {
  CompressionSpec s;
  if (text == "none") {
    return s;
  }
  if (text == "fp16" || text == "bf16") {
    s.kind = text == "fp16" ? Kind::Fp16 : Kind::Bf16;
    return s;
  }
  const std::string prefix = "powersgd";
  if (text.compare(0, prefix.size(), prefix) == 0) {
    s.kind = Kind::PowerSgd;
    if (text.size() == prefix.size()) {
      return s;
    }
    const std::string tail = text.substr(prefix.size());
    bool digits = tail.size() >= 2 && tail[0] == ':' && tail.size() <= 6;
    for (size_t i = 1; digits && i < tail.size(); ++i) {
      digits = tail[i] >= '0' && tail[i] <= '9';
    }
    HDDP_CHECK_AS(
        ConfigError, digits && std::stoi(tail.substr(1)) >= 1, what, " '", text,
        "': the PowerSGD rank follows a colon and is a whole number from 1 to 99999, e.g. "
        "powersgd:4");
    s.rank = std::stoi(tail.substr(1));
    return s;
  }
  HDDP_THROW(ConfigError, what, " '", text,
             "' is not a compression: use none, fp16, bf16, powersgd[:RANK] or auto");
}

double GradientLayout::bytes() const {
  double total = 0.0;
  for (const auto& s : shapes) {
    total += numelOf(s) * elementBytes;
  }
  return total;
}

int GradientLayout::buckets() const { return static_cast<int>(bucketsOf(*this).size()); }

double GradientLayout::lastBucketShare() const {
  const auto buckets = bucketsOf(*this);
  const double total = bytes();
  if (buckets.empty() || !(total > 0)) {
    return 1.0;
  }
  double last = 0.0;
  for (size_t k : buckets.back()) {
    last += numelOf(shapes[k]) * elementBytes;
  }
  return last / total;
}

std::string CompressionCost::describe() const {
  return spec.name() +
         format(": %.3g MB in %.0f allreduces, %.1f ms over the link, %.1f ms compute, ",
                wireBytes / 1e6, messages, allreduceSeconds * 1e3, computeSeconds * 1e3) +
         format("%.1f ms exposed", exposedSeconds * 1e3);
}

CompressionCost compressionTraffic(const CompressionSpec& spec, const GradientLayout& layout) {
  CompressionCost c;
  c.spec = spec;
  const auto buckets = bucketsOf(layout);
  const double total = layout.bytes();
  switch (spec.kind) {
    case CompressionSpec::Kind::None:
      c.wireBytes = total;
      c.messages = static_cast<int>(buckets.size());
      return c;
    case CompressionSpec::Kind::Fp16:
    case CompressionSpec::Kind::Bf16:
      c.wireBytes = total * 2.0 / layout.elementBytes;
      c.messages = static_cast<int>(buckets.size());
      return c;
    case CompressionSpec::Kind::PowerSgd:
      break;
  }
  HDDP_CHECK_AS(ConfigError, !layout.shapes.empty(),
                "PowerSGD's traffic needs the gradients' shapes (GradientLayout::shapes), and "
                "none were given");
  HDDP_CHECK_AS(ConfigError, spec.rank >= 1 && spec.minCompressionRate > 0,
                "PowerSGD needs a rank of at least 1 and a positive minimum compression rate");
  double q = 0.0;
  for (const auto& bucket : buckets) {
    double whole = 0.0;
    double factors = 0.0;
    for (size_t k : bucket) {
      const TensorWire w = powerSgdWire(layout.shapes[k], spec, layout.elementBytes);
      whole += w.whole;
      factors += w.factors;
      q += w.q;
      c.flops += w.flops;
      c.memoryBytes += w.memory;
    }
    c.wireBytes += whole * layout.elementBytes + factors * spec.factorBytes;
    const bool twoTypes = whole > 0 && factors > 0 && spec.factorBytes != layout.elementBytes;
    c.messages += (whole > 0 || factors > 0 ? 1 : 0) + (twoTypes ? 1 : 0) + (factors > 0 ? 1 : 0);
  }
  c.messages += 1;  // DDP's status travels on its own beside a hook's buckets
  c.endShare = c.wireBytes > 0 ? q * spec.factorBytes / c.wireBytes : 0.0;
  return c;
}

CompressionCost priceCompression(CompressionCost cost, const GradientLayout& layout,
                                 const LinkBudget& link, double computeSeconds) {
  cost.computeSeconds = computeSeconds;
  cost.allreduceSeconds = 0.0;
  if (link.ranks > 1 && (link.bytesPerSecond > 0 || link.latencySeconds > 0)) {
    const LinkEmulation l{link.bytesPerSecond, link.latencySeconds};
    cost.allreduceSeconds =
        emulatedCollectiveSeconds(CollectiveKind::Allreduce, cost.wireBytes, link.ranks, l) +
        (cost.messages - 1) *
            emulatedCollectiveSeconds(CollectiveKind::Allreduce, 0.0, link.ranks, l);
  }
  cost.exposedSeconds = exposedAllreduceSeconds(cost.allreduceSeconds, link.backwardSeconds,
                                                layout.lastBucketShare(), cost.endShare) +
                        computeSeconds;
  cost.hidden = exposesLittle(cost.exposedSeconds, link.backwardSeconds);
  return cost;
}

double exposedAllreduceSeconds(double allreduce, double backward, double lastShare,
                               double endShare) {
  if (!(allreduce > 0)) {
    return 0.0;
  }
  return std::max(allreduce - backward, allreduce * std::min(1.0, lastShare + endShare));
}

bool exposesLittle(double exposedSeconds, double backwardSeconds) {
  return exposedSeconds <= 0.05 * backwardSeconds / kBackwardShare;
}

std::vector<CompressionSpec> autoCandidates(AmpMode amp) {
  std::vector<CompressionSpec> c(4);
  c[1].kind = amp == AmpMode::Bf16 ? CompressionSpec::Kind::Bf16 : CompressionSpec::Kind::Fp16;
  c[2].kind = CompressionSpec::Kind::PowerSgd;
  c[2].rank = 4;
  c[3].kind = CompressionSpec::Kind::PowerSgd;
  c[3].rank = 1;
  return c;
}

CompressionDecision chooseCompression(const std::vector<CompressionCost>& priced,
                                      const LinkBudget& link) {
  HDDP_CHECK_AS(ConfigError, !priced.empty(), "choosing a compression needs candidates");
  CompressionDecision d;
  d.candidates = priced;
  double least = priced.front().exposedSeconds;
  for (const auto& c : priced) {
    least = std::min(least, c.exposedSeconds);
  }
  size_t pick = 0;
  while (pick < priced.size() && !priced[pick].hidden) {
    ++pick;
  }
  if (pick == priced.size()) {
    const double tolerance = 0.05 * link.backwardSeconds / kBackwardShare;
    pick = 0;
    while (priced[pick].exposedSeconds > least + tolerance) {
      ++pick;
    }
  }
  d.chosen = priced[pick];
  if (!(link.bytesPerSecond > 0) && !(link.latencySeconds > 0)) {
    d.why = d.chosen.spec.name() +
            ": no link to price (the seed knows none: CPU ranks without an emulated link; "
            "--emulate-link-gbps emulates one), so nothing is worth compressing";
    return d;
  }
  std::string compared;
  for (const auto& c : priced) {
    compared += (compared.empty() ? "" : "; ") + c.describe();
  }
  const std::string link_ = format(
      "%.4g GB/s, %.0f us latency, %.0f ranks, backward %.1f ms: ", link.bytesPerSecond / 1e9,
      link.latencySeconds * 1e6, link.ranks, link.backwardSeconds * 1e3);
  if (d.chosen.hidden && pick == 0) {
    d.why = d.chosen.spec.name() + ": the plain allreduce hides behind backward (" + link_ +
            compared + ")";
  } else if (d.chosen.hidden) {
    d.why = d.chosen.spec.name() +
            ": the most faithful choice that hides its allreduce behind backward (" + link_ +
            compared + ")";
  } else {
    d.why = d.chosen.spec.name() +
            ": no choice hides the allreduce behind backward; this one exposes least, or within "
            "5% of the step of least and more faithfully (" +
            link_ + compared + ")";
  }
  return d;
}

}  // namespace hddp
