// What-if planning: predict how a mix of cards and links would train a model before the
// hardware is there (docs/egpu.md, "Choosing an enclosure"; hddp-probe --what-if).
//
// For each device of the mix (hddp/balance/device_table.h) the model's profile turns
// into the planner's cost (hddp/balance/batch_plan.h):
//
//   compute / sample   with a calibration on table device K:  measured x peak(K) / peak(D)
//                      without:  training FLOPs / (peak(D) x efficiency)
//                                + memory traffic x activation bytes / memory bandwidth(D)
//                      peak = the table's rate for the precision (fp32, or the fp16 / bf16
//                      tensor rate under AMP; a card without that path runs at its fp32 rate).
//                      The two terms are a roofline added up: the products at a share of the
//                      peak, and the elementwise work (normalisation, activations, their
//                      gradients) streaming the saved activations through device memory.
//                      efficiency and memory traffic are fitted to the published training
//                      figures of the device table (its "published" list), and
//                      WhatIfSettings::uncertainty is the largest error of that fit.
//   fixed / step       with a calibration: measured x memory bandwidth(K) / bandwidth(D)
//                      without: the optimizer's update traffic / memory bandwidth(D),
//                      (3 + 2 x state copies) x parameter bytes
//   transfer / sample  input bytes / the link's usable bandwidth; with prefetch the step
//                      pays max(compute, transfer) per sample, else the sum
//   memory             fixed = parameter bytes x (2 + state copies) (weights, gradients,
//                      optimizer state); per sample = the profile's measured activation
//                      bytes; the cap is the Trainer's rule (MemoryEstimator::capFor) with
//                      the CUDA context counted as others' memory
//                      With ZeRO (WhatIfSettings::zero, hddp/ddp/sharded_optimizer.h) device
//                      r holds a share s_r of what is sharded:
//                        ZeRO-1  fixed_r = parameters + gradients + state x s_r
//                        ZeRO-2  fixed_r = parameters + (gradients + state) x s_r
//                      s_r = weight_r / sum of the weights (WhatIfSettings::shardBy): by
//                      memory, weight_r = the device's memory - contextBytes - parameter
//                      bytes (ZeRO-1: - gradient bytes too), at least 0, the free memory
//                      after the model the Trainer measures; equal, 1 each; or the ratios
//                      given. Shards are taken as exact shares (the library's shards are
//                      whole tensors, off by at most half a tensor at each end). The cap
//                      follows per device: a larger shard leaves room for fewer samples.
//
// The split is solveSplit()'s on those costs. The gradient allreduce is a ring over the
// slowest link (ringAllreduceSeconds, the gradients being the fp32 parameters; or at
// WhatIfSettings::allreduceGBps when the ring has its own path); DDP runs
// its buckets during backward (2/3 of the compute), so the exposed part is
//   max(allreduce - backward, allreduce x last bucket / parameter bytes)
// (the last bucket, the first layers' gradients, cannot hide: buckets in reverse
// parameter order are 1 MiB, then 25 MiB each, the remainder last). Step = slowest rank + exposed
// allreduce. Peers: PyTorch DDP's equal split on the same mix, and the fastest card alone (gradient
// accumulation when its memory cannot hold the global batch).
//
// ZeRO's traffic is priced as the allreduce above: each bucket is reduced to its owner
// during backward and the owners broadcast the updated parameters after the step, the
// same bytes as a ring allreduce (reduce-scatter + all-gather). The broadcast follows the
// optimizer step and so cannot hide behind backward, which this price does not count: it
// is optimistic for ZeRO on a slow link. ZeRO sends each bucket whole: with zero > 0,
// fp16, bf16 and PowerSGD compression are a ConfigError (as in TrainerOptions), and auto
// prices none (the Trainer turns compression off under ZeRO).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hddp/amp/amp_mode.h"
#include "hddp/balance/batch_plan.h"
#include "hddp/balance/compression_model.h"
#include "hddp/balance/device_table.h"

namespace hddp {

/// What a model costs per sample, counted and measured from the model itself
/// (hddp/train/model_profile.h), or read back from a file.
struct ModelProfile {
  std::string model;  // "resnet50 3x224x224"
  /// Multiply-adds x 2 of convolutions and matrix products, per sample.
  double forwardFlopsPerSample = 0.0;
  /// Forward and backward (the backward's own products counted, not a rule of thumb).
  double trainFlopsPerSample = 0.0;
  /// Device memory a training step's peak grows by per sample (activations saved for
  /// backward, under the profile's precision), measured at two batch sizes.
  double activationBytesPerSample = 0.0;
  /// fp32 parameters: the weights' bytes, and the gradient bytes each step allreduces.
  double parameterBytes = 0.0;
  /// What the loader moves to the device per sample.
  double inputBytesPerSample = 0.0;
  /// The shape of each parameter's gradient, in the parameters' order (what PowerSGD
  /// compresses; empty in a profile saved before they were recorded).
  std::vector<std::vector<int64_t>> gradientShapes;
  AmpMode amp = AmpMode::Off;
  /// A calibration: the table key of the device it ran on ("" = none), and the training
  /// step it measured there as fixed + perSample x b.
  std::string calibratedOn;
  double calibratedSecondsPerSample = 0.0;
  double calibratedFixedSeconds = 0.0;

  /// JSON text (the file hddp-probe --save-profile writes).
  std::string toJson() const;
  /// Parses toJson()'s text; hddp::ConfigError naming `origin` and the field for a
  /// missing or bad field.
  static ModelProfile fromJson(const std::string& text, const std::string& origin);
};

/// The fit of the uncalibrated model to the device table's published figures
/// (bench/what_if_fit.py: 5 ResNet-50 training figures on 4 cards, largest error 17.5%;
/// the test WhatIf.UncalibratedPredictionsMatchPublishedFigures holds every figure within
/// kFittedUncertainty, which is that error rounded up).
constexpr double kFittedEfficiency = 0.68;
constexpr double kFittedMemoryTraffic = 10.9;
constexpr double kFittedUncertainty = 0.20;

struct WhatIfSettings {
  int64_t globalBatch = 256;
  /// Without a calibration: the share of the table's peak the products (convolutions,
  /// matrix products) reach. Default fitted to the table's published figures, with
  /// memoryTraffic (docs/balance.md, "What-if without a calibration").
  double efficiency = kFittedEfficiency;
  /// Without a calibration: device-memory bytes a training step moves per byte of saved
  /// activations (the elementwise work of forward and backward). Default fitted with
  /// efficiency; 0 = products only.
  double memoryTraffic = kFittedMemoryTraffic;
  /// The relative error the uncalibrated prediction carries: the largest error of the
  /// default fit against the published figures (printed with the prediction).
  double uncertainty = kFittedUncertainty;
  /// Optimizer state per parameter, in copies of the weights (momentum SGD 1, Adam 2).
  double optimizerStateCopies = 1.0;
  /// Each device's memory kept free (the Trainer's PlannerSettings::memoryHeadroom).
  double memoryHeadroom = 0.10;
  /// Device memory the CUDA context and library workspaces hold outside the allocator.
  double contextBytes = 512.0 * (1 << 20);
  /// The loader copies the next batch on a side stream while the device computes.
  bool prefetch = true;
  /// DDP's gradient buckets: the first (the last layers' gradients) and the others
  /// (1 MiB and 25 MiB, PyTorch's and hddp's defaults).
  double firstBucketBytes = 1.0 * (1 << 20);
  double bucketBytes = 25.0 * (1 << 20);
  /// The bandwidth the gradient ring runs at when it is not the slowest device link
  /// (GB/s; cards joined by NVLink, ranks of one host over loopback); 0 = that link.
  double allreduceGBps = 0.0;
  /// What DDP sends for the gradients: none, fp16, bf16, powersgd[:R] (priced by
  /// hddp/balance/compression_model.h, PowerSGD's compute from the table's fp32 peak at
  /// `efficiency` and its memory bandwidth), or auto (each priced, the Trainer's choice).
  std::string compression = "none";
  /// ZeRO (hddp/ddp/sharded_optimizer.h, the trainers' --zero): 0 plain data parallelism,
  /// 1 the optimizer state sharded across the devices, 2 the gradients too. Default 0.
  int zero = 0;
  /// With zero > 0, how the shards are sized, as the trainers' --shard-by: "memory" (each
  /// device's free memory after the model; the default), "equal", or one ratio per device
  /// of the mix, "R0:R1:..." (numbers >= 0, not all 0). Text, not the ddp layer's
  /// hddp::ShardBy, which is a layer above balance; predictMix parses it (ConfigError
  /// naming the text).
  std::string shardBy = "memory";
};

/// One device of a predicted mix.
struct WhatIfDevice {
  MixEntry entry;
  RankCost cost;
  int64_t local = 0;
  int64_t memoryCap = 0;         // the largest share its memory holds
  double peakTflops = 0.0;       // the rate used (after the precision fallback)
  double computeSeconds = 0.0;   // local x compute per sample
  double transferSeconds = 0.0;  // local x input transfer per sample (hidden or not)
  double stepSeconds = 0.0;      // its predicted time for the step, allreduce apart
  double memoryBytes = 0.0;      // predicted peak at `local`: the four parts below
  /// Its memory by part (bytes): the weights (whole on every device), the gradient buffers
  /// it keeps (all, or its shard under ZeRO-2), its optimizer state (all, or its shard
  /// under ZeRO), and the activations of `local` samples.
  double parameterBytes = 0.0;
  double gradientBytes = 0.0;
  double stateBytes = 0.0;
  double activationBytes = 0.0;
  /// Its share of the optimizer state (0..1; 1 without ZeRO).
  double shareOfState = 1.0;
};

struct WhatIfResult {
  std::vector<WhatIfDevice> devices;
  BatchPlan plan;
  double allreduceSeconds = 0.0;  // the whole ring allreduce of the gradients
  double exposedAllreduceSeconds = 0.0;
  double slowestLinkGBps = 0.0;
  double stepSeconds = 0.0;  // slowest device + exposed allreduce (+ compression compute)
  /// The compression priced (WhatIfSettings::compression, or auto's choice); with auto,
  /// every candidate and why the choice won.
  CompressionCost compression;
  std::vector<CompressionCost> compressionCandidates;
  std::string compressionWhy;
  double samplesPerSecond = 0.0;
  /// PyTorch DDP's equal split on the same mix; 0 when a share exceeds a device's memory.
  double equalSplitSamplesPerSecond = 0.0;
  /// The fastest device of the mix training the whole batch alone, and which it is.
  double fastestAloneSamplesPerSecond = 0.0;
  int fastest = 0;
  std::vector<std::string> advice;
};

/// The planner's cost of each device of `mix` for `profile` (its memory cap under
/// WhatIfSettings::zero); ConfigError when a calibration names a device the table lacks,
/// or for a bad zero, shardBy or zero with compression.
std::vector<RankCost> whatIfCosts(const std::vector<MixEntry>& mix, const ModelProfile& profile,
                                  const WhatIfSettings& settings, const DeviceTable& table);

/// The prediction for `mix` (see the header comment); `table` resolves the device a
/// calibration ran on. ConfigError when the devices' memory cannot hold the global batch.
WhatIfResult predictMix(const std::vector<MixEntry>& mix, const ModelProfile& profile,
                        const WhatIfSettings& settings, const DeviceTable& table);

/// The peak rate (TFLOPS) `device` runs `amp` at: its fp16 / bf16 tensor rate, or its
/// fp32 rate when it has no such path (or AMP is off).
double peakTflopsFor(const DeviceSpec& device, AmpMode amp);

/// Each device's share of the optimizer state under WhatIfSettings::zero and shardBy (all
/// 1 with zero 0; summing to 1 otherwise). ConfigError for a zero other than 0, 1, 2, a
/// bad shardBy text, ratios not one per device, or no device with memory left after the
/// model (shardBy memory).
std::vector<double> stateShares(const std::vector<MixEntry>& mix, const ModelProfile& profile,
                                const WhatIfSettings& settings);

}  // namespace hddp
