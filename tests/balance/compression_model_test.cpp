// The compression model behind --compress auto and what-if --compress
// (hddp/balance/compression_model.h): bytes and messages per choice, the ring over the
// link, what backward hides, and the choice.
#include "hddp/balance/compression_model.h"

#include <gtest/gtest.h>

#include "hddp/core/error.h"

namespace {

using hddp::CompressionCost;
using hddp::CompressionSpec;
using hddp::GradientLayout;
using hddp::LinkBudget;

// A 64 -> 32 -> 10 MLP: weight 32x64, bias 32, weight 10x32, bias 10 (float32).
GradientLayout mlp() {
  GradientLayout g;
  g.shapes = {{32, 64}, {32}, {10, 32}, {10}};
  return g;
}

CompressionSpec powerSgd(int rank) {
  CompressionSpec s;
  s.kind = CompressionSpec::Kind::PowerSgd;
  s.rank = rank;
  return s;
}

TEST(CompressionModel, ParsesTheTrainersChoicesAndRejectsTheRestSayingWhatIsValid) {
  EXPECT_EQ(CompressionSpec::parse("none").name(), "none");
  EXPECT_EQ(CompressionSpec::parse("fp16").name(), "fp16");
  EXPECT_EQ(CompressionSpec::parse("bf16").name(), "bf16");
  EXPECT_EQ(CompressionSpec::parse("powersgd").name(), "powersgd:1");
  EXPECT_EQ(CompressionSpec::parse("powersgd:4").rank, 4);
  for (const char* bad : {"powersgd:0", "powersgd:", "powersgd:x", "powersgd4", "zip", ""}) {
    try {
      CompressionSpec::parse(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const hddp::ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("powersgd"), std::string::npos) << what;
    }
  }
}

TEST(CompressionModel, CountsTheBytesAndMessagesEachChoiceSends) {
  const GradientLayout g = mlp();
  const double elements = 32 * 64 + 32 + 10 * 32 + 10;
  ASSERT_DOUBLE_EQ(g.bytes(), 4 * elements);
  ASSERT_EQ(g.buckets(), 1);
  EXPECT_DOUBLE_EQ(hddp::compressionTraffic(CompressionSpec{}, g).wireBytes, 4 * elements);
  EXPECT_EQ(hddp::compressionTraffic(CompressionSpec{}, g).messages, 1);
  EXPECT_DOUBLE_EQ(hddp::compressionTraffic(CompressionSpec::parse("bf16"), g).wireBytes,
                   2 * elements);
  // Rank 4: 32x64 -> (32 + 64) x 4 = 384 (x2 < 2048: compressed); 10x32 -> 42 x 4 = 168
  // (x2 = 336 > 320: sent whole); the biases whole.
  const CompressionCost c4 = hddp::compressionTraffic(powerSgd(4), g);
  EXPECT_DOUBLE_EQ(c4.wireBytes, 4 * (384.0 + 320 + 32 + 10));
  EXPECT_EQ(c4.messages, 3);  // the whole ones with P, then Q, then DDP's status
  // Q (64 x 4) goes out only once every bucket's first round is done.
  EXPECT_DOUBLE_EQ(c4.endShare, 4.0 * 64 * 4 / c4.wireBytes);
  EXPECT_EQ(hddp::compressionTraffic(CompressionSpec{}, g).endShare, 0.0);
  EXPECT_DOUBLE_EQ(c4.flops, 3 * 2.0 * 32 * 64 * 4 + 2.0 * 32 * 16);
  // Rank 1 compresses both matrices.
  EXPECT_DOUBLE_EQ(hddp::compressionTraffic(powerSgd(1), g).wireBytes, 4 * (96.0 + 42 + 32 + 10));
  // P and Q in fp16 halve the factors' bytes and travel apart from the float32 ones.
  CompressionSpec half = powerSgd(4);
  half.factorBytes = 2;
  const CompressionCost h = hddp::compressionTraffic(half, g);
  EXPECT_DOUBLE_EQ(h.wireBytes, 2 * 384.0 + 4 * (320 + 32 + 10));
  EXPECT_EQ(h.messages, 4);
}

TEST(CompressionModel, BucketsFollowDdpsCaps) {
  GradientLayout g;
  g.shapes = {{1000, 1000}, {1000}, {300, 1000}, {300}};  // 4 MB, 4 kB, 1.2 MB, 1.2 kB
  // Reverse order: {300} + {300,1000} reach the 1 MiB first cap, the rest fill one bucket.
  EXPECT_EQ(g.buckets(), 2);
  EXPECT_NEAR(g.lastBucketShare(), (4e6 + 4e3) / g.bytes(), 1e-12);
  g.bucketCapBytes = 1e3;
  EXPECT_EQ(g.buckets(), 3);
}

TEST(CompressionModel, PricesTheRingAndWhatBackwardHides) {
  const GradientLayout g = mlp();
  LinkBudget link;
  link.ranks = 4;
  link.bytesPerSecond = 1e6;
  link.latencySeconds = 1e-3;
  link.backwardSeconds = 2e-3;
  const CompressionCost none =
      hddp::priceCompression(hddp::compressionTraffic(CompressionSpec{}, g), g, link, 0.0);
  // 2 (n-1)/n x bytes / B + 2 (n-1) x latency.
  const double ring = 1.5 * g.bytes() / 1e6 + 6e-3;
  EXPECT_NEAR(none.allreduceSeconds, ring, 1e-12);
  EXPECT_FALSE(none.hidden);
  // One bucket: it is the last, and nothing of it hides.
  EXPECT_NEAR(none.exposedSeconds, ring, 1e-12);
  // Three messages pay three latencies; compute is added in line with backward.
  const CompressionCost p =
      hddp::priceCompression(hddp::compressionTraffic(powerSgd(4), g), g, link, 0.5e-3);
  EXPECT_NEAR(p.allreduceSeconds, 1.5 * p.wireBytes / 1e6 + 3 * 6e-3, 1e-12);
  EXPECT_NEAR(p.exposedSeconds, p.allreduceSeconds + 0.5e-3, 1e-12);
  // Of many buckets, the last bucket's share and what goes out after backward (Q) show.
  EXPECT_NEAR(hddp::exposedAllreduceSeconds(10.0, 2.0, 0.25, 0.0), 8.0, 1e-12);
  EXPECT_NEAR(hddp::exposedAllreduceSeconds(10.0, 9.0, 0.25, 0.0), 2.5, 1e-12);
  EXPECT_NEAR(hddp::exposedAllreduceSeconds(10.0, 9.0, 0.25, 0.125), 3.75, 1e-12);
  EXPECT_NEAR(hddp::exposedAllreduceSeconds(10.0, 9.0, 0.75, 0.5), 10.0, 1e-12);
  EXPECT_EQ(hddp::exposedAllreduceSeconds(0.0, 9.0, 0.75, 0.5), 0.0);
  // With backward long enough it hides, but the last bucket (here the only one) shows.
  link.backwardSeconds = 1.0;
  const CompressionCost hidden =
      hddp::priceCompression(hddp::compressionTraffic(CompressionSpec{}, g), g, link, 0.0);
  EXPECT_TRUE(hidden.hidden);
  EXPECT_NEAR(hidden.exposedSeconds, ring * g.lastBucketShare(), 1e-12);
}

// The choice among none, fp16, powersgd:4 and powersgd:1 for a ResNet-sized layout.
struct Choice {
  std::string name;
  std::string why;
};
// Eight 256 x 256 x 3 x 3 convolutions with biases (18.9 MB); `bucketCap` 1 MB puts each
// in a bucket of its own (the last 12.5% of the bytes), the default 25 MiB most in one.
Choice chooseFor(double bytesPerSecond, double backwardSeconds, double powerSgdCompute = 0.0,
                 double bucketCap = 25 << 20) {
  GradientLayout g;
  for (int k = 0; k < 8; ++k) {
    g.shapes.push_back({256, 256, 3, 3});
    g.shapes.push_back({256});
  }
  g.bucketCapBytes = bucketCap;
  LinkBudget link;
  link.ranks = 2;
  link.bytesPerSecond = bytesPerSecond;
  link.backwardSeconds = backwardSeconds;
  std::vector<CompressionCost> priced;
  for (const auto& spec : hddp::autoCandidates(hddp::AmpMode::Off)) {
    const double compute = spec.kind == CompressionSpec::Kind::PowerSgd ? powerSgdCompute : 0.0;
    priced.push_back(hddp::priceCompression(hddp::compressionTraffic(spec, g), g, link, compute));
  }
  EXPECT_EQ(priced.size(), 4u);
  const auto d = hddp::chooseCompression(priced, link);
  return {d.chosen.spec.name(), d.why};
}

TEST(CompressionModel, AutoKeepsThePlainAllreduceWhereBackwardHidesIt) {
  // 18.9 MB over 25 GB/s: 0.75 ms, behind 50 ms of backward.
  const Choice c = chooseFor(25e9, 50e-3);
  EXPECT_EQ(c.name, "none");
  EXPECT_NE(c.why.find("hides behind backward"), std::string::npos) << c.why;
}

TEST(CompressionModel, AutoTakesTheMostFaithfulChoiceThatHides) {
  // 18.9 MB over 1 GB/s in buckets of one convolution, behind 20 ms of backward (a step
  // of 30 ms: 1.5 ms may show). Plain: 18.9 ms, its last bucket 2.4 ms shows; fp16:
  // 9.4 ms, 1.2 ms shows: fp16.
  const Choice c = chooseFor(1e9, 20e-3, 0.0, 1e6);
  EXPECT_EQ(c.name, "fp16") << c.why;
  EXPECT_NE(c.why.find("the most faithful choice that hides"), std::string::npos) << c.why;
  // With most of the gradients in one bucket, fp16's last bucket shows 8.3 ms; PowerSGD
  // rank 4 (0.34 MB, 0.34 ms) hides.
  EXPECT_EQ(chooseFor(1e9, 20e-3).name, "powersgd:4");
  // Over 0.1 GB/s fp16 does not fit in 50 ms of backward either; PowerSGD rank 4's Q
  // round (most of its 3.4 ms) shows after backward, within the 3.75 ms allowed.
  EXPECT_EQ(chooseFor(0.1e9, 50e-3, 0.0, 1e6).name, "powersgd:4");
}

TEST(CompressionModel, AutoTakesTheLeastExposedWhereNothingHidesPreferringFidelityOnATie) {
  // 5 MB/s: rank 4 sends 0.34 MB (67 ms), rank 1 0.09 MB (18 ms), backward 5 ms: rank 1
  // exposes 47 ms less, far beyond 5% of the 7.5 ms step.
  EXPECT_EQ(chooseFor(5e6, 5e-3).name, "powersgd:1");
  // With a 1 s backward both hide, and rank 4 is the more faithful.
  EXPECT_EQ(chooseFor(5e6, 1.0).name, "powersgd:4");
  // PowerSGD's compute counts: at 100 ms it costs more than fp16's exposed allreduce.
  const Choice c = chooseFor(1e9, 5e-3, 0.1);
  EXPECT_EQ(c.name, "fp16");
  EXPECT_NE(c.why.find("powersgd:4"), std::string::npos) << c.why;
}

TEST(CompressionModel, AutoWithoutALinkToPriceSendsPlain) {
  const Choice c = chooseFor(0.0, 5e-3);
  EXPECT_EQ(c.name, "none");
  EXPECT_NE(c.why.find("no link to price"), std::string::npos) << c.why;
}

}  // namespace
