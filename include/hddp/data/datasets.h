// Dataset readers and synthetic datasets.
//
// Image classification sets hold their images as uint8 [N, C, H, W] in memory (MNIST,
// Fashion-MNIST, CIFAR-10 are small) or decode files on demand in the loader's
// workers (image folders). `get` returns a float image scaled to [0, 1], normalised by
// the transform's mean/std, augmented when asked (random crop after zero padding,
// horizontal flip), and the label as an int64 scalar.
//
//   auto train = hddp::loadMnist("/usr/share/datasets/fashion-mnist", hddp::Split::Train);
//   train->setTransform(hddp::ImageTransform::standard(*train, /*augment=*/true));
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hddp/data/dataset.h"

namespace hddp {

enum class Split { Train, Test };

/// Normalisation and augmentation of an image (and of its mask for segmentation:
/// crops and flips are applied identically to both; normalisation to the image only).
struct ImageTransform {
  /// Per-channel mean and std subtracted / divided after scaling to [0, 1]; empty = none.
  std::vector<float> mean;
  std::vector<float> std;
  /// Random crop back to the original size after zero padding by this many pixels
  /// (4 for CIFAR-10, 2 for 28 px images); 0 = off.
  int padCrop = 0;
  /// Random horizontal flip with probability 0.5 (not for digits).
  bool horizontalFlip = false;
};

/// In-memory images [N, C, H, W] uint8 and labels [N] int64.
class ImageClassificationDataset : public Dataset {
 public:
  ImageClassificationDataset(at::Tensor images, at::Tensor labels, int64_t classes,
                             std::string name);
  int64_t size() const override;
  Example get(int64_t index, SampleRng& rng) const override;
  std::string describe() const override;
  void setTransform(ImageTransform transform) { transform_ = std::move(transform); }
  const ImageTransform& transform() const { return transform_; }
  int64_t classes() const { return classes_; }
  int64_t channels() const;
  int64_t height() const;
  int64_t width() const;
  const at::Tensor& images() const { return images_; }
  const at::Tensor& labels() const { return labels_; }
  /// Per-channel mean and std of the images scaled to [0, 1] (for the transform).
  std::pair<std::vector<float>, std::vector<float>> channelStats() const;

 private:
  at::Tensor images_;
  at::Tensor labels_;
  int64_t classes_;
  std::string name_;
  ImageTransform transform_;
};

/// Applies `transform` to an image [C, H, W] (float in [0, 1]) and, when defined, to
/// its mask [H, W] (crop/flip only). Exposed for tests and custom datasets.
void applyTransform(const ImageTransform& transform, at::Tensor& image, at::Tensor* mask,
                    SampleRng& rng);

/// Reads one IDX file (optionally .gz): the tensor with the file's dimensions and dtype
/// (uint8 for MNIST). Throws hddp::DataError naming the file on any format problem.
at::Tensor readIdx(const std::string& path);

/// MNIST or Fashion-MNIST from a folder holding {train,t10k}-{images-idx3,labels-idx1}
/// -ubyte[.gz] (Debian's dataset-fashion-mnist: /usr/share/datasets/fashion-mnist).
std::shared_ptr<ImageClassificationDataset> loadMnist(const std::string& dir, Split split);

/// CIFAR-10 binary version: data_batch_{1..5}.bin / test_batch.bin in `dir` or in
/// `dir`/cifar-10-batches-bin.
std::shared_ptr<ImageClassificationDataset> loadCifar10(const std::string& dir, Split split);

/// Class-per-subfolder images (PNG, JPEG, BMP, ...; decoded by decodeImage in the
/// loader's workers). Classes are the subfolder names in sorted order. Every image is
/// resized to `size` x `size` (bilinear) unless size is 0 (then all must share one size)
/// and converted to `channels` (1 or 3).
class ImageFolderDataset : public Dataset {
 public:
  ImageFolderDataset(const std::string& dir, int channels, int size);
  int64_t size() const override { return static_cast<int64_t>(files_.size()); }
  Example get(int64_t index, SampleRng& rng) const override;
  std::string describe() const override;
  void setTransform(ImageTransform transform) { transform_ = std::move(transform); }
  const std::vector<std::string>& classNames() const { return classes_; }
  int64_t classes() const { return static_cast<int64_t>(classes_.size()); }
  int channels() const { return channels_; }
  int imageSize() const { return size_; }

 private:
  std::string dir_;
  int channels_;
  int size_;
  std::vector<std::string> classes_;
  std::vector<std::pair<std::string, int64_t>> files_;
  ImageTransform transform_;
};

/// What decodeImage refuses before its decoder allocates anything for an image's pixels:
/// image files come from outside (DESIGN.md, "Readers of outside bytes are bounded").
struct ImageLimits {
  /// Width x height at most. Default 2^28 (16384 x 16384, 256 MiB a channel): a decoder
  /// holds up to 8 bytes a pixel (16-bit RGBA PNG) besides the result, 2 GiB at this limit.
  int64_t maxPixels = int64_t{1} << 28;
};

/// Decodes an image file into uint8 [channels, H, W] (channels 1 or 3), by what its first
/// bytes say: PNG with libpng, JPEG with libjpeg-turbo (its defaults, as Pillow decodes),
/// binary PGM/PPM (P5/P6) with hddp's own reader (1-byte samples as stored, whatever the
/// maxval; 2-byte samples of maxval 65535 keep their high byte, as a 16-bit PNG's do, and
/// of a smaller maxval are scaled to 0..255, rounded), GIF, BMP and TGA with stb_image. Channels
/// are converted as stb_image converts them: gray to RGB by copying, RGB to gray as (77 R + 150 G +
/// 29 B) >> 8 (a YCbCr JPEG gives its Y plane), alpha dropped. hddp::DataError naming the file and
/// what is wrong when it cannot be decoded, and before decoding when it is larger than `limits` or
/// claims more pixels than its bytes can describe in its format. Thread-safe: any number of calls
/// at once.
at::Tensor decodeImage(const std::string& path, int channels, const ImageLimits& limits = {});

/// Learnable synthetic classification: each class is a fixed random pattern, each
/// sample that pattern plus noise, seeded (sample i is the same on every rank and run).
class SyntheticClassificationDataset : public Dataset {
 public:
  SyntheticClassificationDataset(int64_t samples, int channels, int size, int64_t classes,
                                 uint64_t seed = 0, float noise = 0.5f);
  int64_t size() const override { return samples_; }
  Example get(int64_t index, SampleRng& rng) const override;
  std::string describe() const override;
  int64_t classes() const { return classes_; }

 private:
  int64_t samples_;
  int channels_;
  int size_;
  int64_t classes_;
  uint64_t seed_;
  float noise_;
  at::Tensor patterns_;  // [classes, C, H, W]
};

/// Segmentation: input image [C, H, W] float, target mask [H, W] int64 class ids.
/// Synthetic shapes: random filled ellipses and convex polygons on a noisy background;
/// class 1 = ellipse, 2 = polygon (0 = background), exact masks, seeded per sample.
class SyntheticShapesDataset : public Dataset {
 public:
  SyntheticShapesDataset(int64_t samples, int size, uint64_t seed = 0, int channels = 1);
  int64_t size() const override { return samples_; }
  Example get(int64_t index, SampleRng& rng) const override;
  std::string describe() const override;
  static constexpr int64_t kClasses = 3;

 private:
  int64_t samples_;
  int size_;
  uint64_t seed_;
  int channels_;
};

/// Image/mask folder pairs: `dir`/images/NAME.png and `dir`/masks/NAME.png (any format
/// decodeImage reads; the mask is matched by file stem). Mask pixels are class ids
/// (0..K-1, K <= 256) as the file stores them: a palette PNG's indices (PASCAL VOC), gray
/// values (16-bit ones too while they fit), RGB whose three colors are equal; other
/// colors are a DataError naming the pixel. A mask that only holds 0 and 255 is read as
/// binary (255 -> 1). Images are resized to `size` (bilinear; masks nearest) unless 0.
class SegmentationFolderDataset : public Dataset {
 public:
  SegmentationFolderDataset(const std::string& dir, int channels, int size);
  int64_t size() const override { return static_cast<int64_t>(pairs_.size()); }
  Example get(int64_t index, SampleRng& rng) const override;
  std::string describe() const override;
  void setTransform(ImageTransform transform) { transform_ = std::move(transform); }
  /// Classes: 1 + the largest class id in the masks (scanned at construction).
  int64_t classes() const { return classes_; }

 private:
  std::string dir_;
  int channels_;
  int size_;
  int64_t classes_ = 2;
  bool binary255_ = false;
  std::vector<std::pair<std::string, std::string>> pairs_;
  ImageTransform transform_;
};

/// Keeps `count` samples of `base` starting at `offset` (e.g. a fast CI run).
class SubsetDataset : public Dataset {
 public:
  SubsetDataset(std::shared_ptr<const Dataset> base, int64_t offset, int64_t count);
  int64_t size() const override { return count_; }
  Example get(int64_t index, SampleRng& rng) const override;
  std::string describe() const override;

 private:
  std::shared_ptr<const Dataset> base_;
  int64_t offset_;
  int64_t count_;
};

}  // namespace hddp
