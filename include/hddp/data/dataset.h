// Datasets: what the loader reads samples from.
//
// A Dataset maps an index to one Example (input and target tensors). The loader calls
// `get` from several worker threads at once, so implementations must be thread-safe
// (they usually are: `get` is const and reads immutable data or files). Augmentation
// draws from the `rng` the loader passes: it is seeded from (seed, epoch, index), so a
// sample looks the same whatever the number of workers or the order they run in.
//
// Readers for real data (IDX/MNIST, CIFAR-10, image folders) and synthetic sets are in
// hddp/data/datasets.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace hddp {

/// One sample: e.g. an image [C, H, W] (float) and its label (int64 scalar) or mask.
struct Example {
  at::Tensor input;
  at::Tensor target;
};

using SampleRng = std::mt19937_64;

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// Sample `index`, 0 <= index < size(). Thread-safe; throws on unreadable data.
  virtual Example get(int64_t index, SampleRng& rng) const = 0;
  /// One line for logs, e.g. "Fashion-MNIST train: 60000 images 1x28x28, 10 classes".
  virtual std::string describe() const;
};

/// Stacks examples into a batch (inputs [n, ...], targets [n, ...]); every example must
/// have the same shapes. `pinned`: allocate in page-locked memory (CUDA only).
Example collate(const std::vector<Example>& examples, bool pinned = false);

/// The seed of one sample's augmentation RNG: a mix of the three, so neighbouring
/// indices and epochs get unrelated streams.
uint64_t sampleSeed(uint64_t seed, int64_t epoch, int64_t index);

}  // namespace hddp
