// The dataset classes: in-memory images, image and segmentation folders, synthetic
// data, subsets. File formats are in file_formats.cpp, image operations in image_ops.cpp.
#include "hddp/data/datasets.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "data/image_io.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace fs = std::filesystem;

namespace hddp {

using data::decodeMask;
using data::isImageFile;
using data::resizeImage;
using data::resizeMask;
using data::toFloatImage;

// ---- in-memory image classification -----------------------------------------------

ImageClassificationDataset::ImageClassificationDataset(at::Tensor images, at::Tensor labels,
                                                       int64_t classes, std::string name)
    : images_(std::move(images)),
      labels_(std::move(labels)),
      classes_(classes),
      name_(std::move(name)) {
  HDDP_CHECK_AS(DataError, images_.dim() == 4 && images_.scalar_type() == at::kByte, name_,
                ": images must be uint8 [N, C, H, W], got ", images_.sizes(), " ", images_.dtype());
  HDDP_CHECK_AS(DataError, labels_.dim() == 1 && labels_.size(0) == images_.size(0), name_, ": ",
                labels_.numel(), " labels for ", images_.size(0), " images");
  labels_ = labels_.to(at::kLong).contiguous();
  images_ = images_.contiguous();
  if (labels_.numel() > 0) {
    const int64_t lo = labels_.min().item<int64_t>();
    const int64_t hi = labels_.max().item<int64_t>();
    HDDP_CHECK_AS(DataError, lo >= 0 && hi < classes_, name_, ": labels span [", lo, ", ", hi,
                  "] but there are ", classes_, " classes");
  }
}

int64_t ImageClassificationDataset::size() const { return images_.size(0); }
int64_t ImageClassificationDataset::channels() const { return images_.size(1); }
int64_t ImageClassificationDataset::height() const { return images_.size(2); }
int64_t ImageClassificationDataset::width() const { return images_.size(3); }

Example ImageClassificationDataset::get(int64_t index, SampleRng& rng) const {
  HDDP_CHECK_AS(DataError, index >= 0 && index < size(), name_, ": sample ", index,
                " out of range [0, ", size(), ")");
  at::Tensor image = toFloatImage(images_[index]);
  applyTransform(transform_, image, nullptr, rng);
  return Example{image, labels_[index].clone()};
}

std::string ImageClassificationDataset::describe() const {
  std::ostringstream out;
  out << name_ << ": " << size() << " images " << channels() << "x" << height() << "x" << width()
      << ", " << classes_ << " classes";
  return out.str();
}

std::pair<std::vector<float>, std::vector<float>> ImageClassificationDataset::channelStats() const {
  std::vector<float> mean;
  std::vector<float> std;
  for (int64_t c = 0; c < channels(); ++c) {
    auto values = images_.select(1, c).to(at::kDouble).div(255.0);
    mean.push_back(static_cast<float>(values.mean().item<double>()));
    std.push_back(static_cast<float>(values.std().item<double>()));
  }
  return {mean, std};
}

// ---- image folders ----------------------------------------------------------------------

ImageFolderDataset::ImageFolderDataset(const std::string& dir, int channels, int size)
    : dir_(dir), channels_(channels), size_(size) {
  HDDP_CHECK_AS(DataError, fs::is_directory(dir), "image folder ", dir, " does not exist");
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_directory()) {
      classes_.push_back(entry.path().filename().string());
    }
  }
  std::sort(classes_.begin(), classes_.end());
  HDDP_CHECK_AS(DataError, !classes_.empty(), "image folder ", dir,
                " has no class subfolders (expected DIR/<class>/<image>)");
  for (size_t c = 0; c < classes_.size(); ++c) {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(fs::path(dir) / classes_[c])) {
      if (entry.is_regular_file() && isImageFile(entry.path())) {
        names.push_back(entry.path().string());
      }
    }
    std::sort(names.begin(), names.end());
    for (auto& name : names) {
      files_.emplace_back(std::move(name), static_cast<int64_t>(c));
    }
  }
  HDDP_CHECK_AS(DataError, !files_.empty(), "image folder ", dir, " has no images");
}

Example ImageFolderDataset::get(int64_t index, SampleRng& rng) const {
  HDDP_CHECK_AS(DataError, index >= 0 && index < size(), "image folder sample ", index,
                " out of range");
  const auto& [path, label] = files_[static_cast<size_t>(index)];
  at::Tensor image = resizeImage(toFloatImage(decodeImage(path, channels_)), size_);
  applyTransform(transform_, image, nullptr, rng);
  return Example{image, at::scalar_tensor(label, at::kLong)};
}

std::string ImageFolderDataset::describe() const {
  std::ostringstream out;
  out << "image folder " << dir_ << ": " << size() << " images, " << classes() << " classes";
  if (size_ > 0) {
    out << ", resized to " << size_ << "x" << size_;
  }
  return out.str();
}

// ---- synthetic -------------------------------------------------------------------------

SyntheticClassificationDataset::SyntheticClassificationDataset(int64_t samples, int channels,
                                                               int size, int64_t classes,
                                                               uint64_t seed, float noise)
    : samples_(samples),
      channels_(channels),
      size_(size),
      classes_(classes),
      seed_(seed),
      noise_(noise) {
  HDDP_CHECK_AS(DataError, samples > 0 && channels > 0 && size > 0 && classes > 1,
                "synthetic classification needs samples, channels, size > 0 and classes > 1");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(sampleSeed(seed, -2, 0));
  // Smooth class patterns: low-resolution noise upsampled, so convolutions can learn them.
  namespace F = torch::nn::functional;
  const int64_t coarse = std::max<int64_t>(2, size / 4);
  at::Tensor low = at::randn({classes, channels, coarse, coarse}, gen);
  patterns_ = F::interpolate(low, F::InterpolateFuncOptions()
                                      .size(std::vector<int64_t>{size, size})
                                      .mode(torch::kBilinear)
                                      .align_corners(false))
                  .contiguous();
}

Example SyntheticClassificationDataset::get(int64_t index, SampleRng& rng) const {
  (void)rng;
  HDDP_CHECK_AS(DataError, index >= 0 && index < samples_, "synthetic sample ", index,
                " out of range");
  SampleRng own(sampleSeed(seed_, -1, index));
  const int64_t label = static_cast<int64_t>(own() % static_cast<uint64_t>(classes_));
  std::normal_distribution<float> normal(0.0f, noise_);
  at::Tensor image = patterns_[label].clone();
  float* p = image.data_ptr<float>();
  for (int64_t i = 0; i < image.numel(); ++i) {
    p[i] += normal(own);
  }
  return Example{image, at::scalar_tensor(label, at::kLong)};
}

std::string SyntheticClassificationDataset::describe() const {
  std::ostringstream out;
  out << "synthetic classification: " << samples_ << " images " << channels_ << "x" << size_ << "x"
      << size_ << ", " << classes_ << " classes (seed " << seed_ << ")";
  return out.str();
}

SyntheticShapesDataset::SyntheticShapesDataset(int64_t samples, int size, uint64_t seed,
                                               int channels)
    : samples_(samples), size_(size), seed_(seed), channels_(channels) {
  HDDP_CHECK_AS(DataError, samples > 0 && size >= 8 && (channels == 1 || channels == 3),
                "synthetic shapes needs samples > 0, size >= 8 and 1 or 3 channels");
}

Example SyntheticShapesDataset::get(int64_t index, SampleRng& rng) const {
  (void)rng;
  HDDP_CHECK_AS(DataError, index >= 0 && index < samples_, "synthetic shapes sample ", index,
                " out of range");
  SampleRng own(sampleSeed(seed_, -1, index));
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.1f);
  const int s = size_;
  at::Tensor mask = at::zeros({s, s}, at::kLong);
  at::Tensor image = at::empty({channels_, s, s}, at::kFloat);
  auto m = mask.accessor<int64_t, 2>();
  auto img = image.accessor<float, 3>();
  std::vector<float> background(channels_);
  for (auto& b : background) {
    b = 0.1f + 0.2f * unit(own);
  }
  for (int c = 0; c < channels_; ++c) {
    for (int y = 0; y < s; ++y) {
      for (int x = 0; x < s; ++x) {
        img[c][y][x] = background[c];
      }
    }
  }
  const int shapes = 1 + static_cast<int>(own() % 3);
  for (int k = 0; k < shapes; ++k) {
    const bool ellipse = own() % 2 == 0;
    const float cx = s * (0.2f + 0.6f * unit(own));
    const float cy = s * (0.2f + 0.6f * unit(own));
    const float r = s * (0.1f + 0.15f * unit(own));
    std::vector<float> color(channels_);
    for (auto& c : color) {
      c = 0.5f + 0.5f * unit(own);
    }
    // Ellipse: radii and rotation; polygon: 3-6 vertices at sorted angles (convex).
    const float ry = r * (0.5f + 0.5f * unit(own));
    const float angle = 3.14159265f * unit(own);
    std::vector<std::pair<float, float>> vertices;
    if (!ellipse) {
      const int n = 3 + static_cast<int>(own() % 4);
      std::vector<float> angles(n);
      for (auto& a : angles) {
        a = 6.2831853f * unit(own);
      }
      std::sort(angles.begin(), angles.end());
      for (float a : angles) {
        vertices.emplace_back(cx + r * std::cos(a), cy + r * std::sin(a));
      }
    }
    const float ca = std::cos(angle);
    const float sa = std::sin(angle);
    for (int y = 0; y < s; ++y) {
      for (int x = 0; x < s; ++x) {
        const float px = x + 0.5f;
        const float py = y + 0.5f;
        bool inside = true;
        if (ellipse) {
          const float dx = px - cx;
          const float dy = py - cy;
          const float u = (dx * ca + dy * sa) / r;
          const float v = (-dx * sa + dy * ca) / ry;
          inside = u * u + v * v <= 1.0f;
        } else {
          for (size_t i = 0; i < vertices.size() && inside; ++i) {
            const auto& a = vertices[i];
            const auto& b = vertices[(i + 1) % vertices.size()];
            const float cross =
                (b.first - a.first) * (py - a.second) - (b.second - a.second) * (px - a.first);
            inside = cross >= 0.0f;
          }
        }
        if (inside) {
          m[y][x] = ellipse ? 1 : 2;
          for (int c = 0; c < channels_; ++c) {
            img[c][y][x] = color[c];
          }
        }
      }
    }
  }
  float* p = image.data_ptr<float>();
  for (int64_t i = 0; i < image.numel(); ++i) {
    p[i] += noise(own);
  }
  return Example{image, mask};
}

std::string SyntheticShapesDataset::describe() const {
  std::ostringstream out;
  out << "synthetic shapes: " << samples_ << " images " << channels_ << "x" << size_ << "x" << size_
      << ", 3 classes (background, ellipse, polygon; seed " << seed_ << ")";
  return out.str();
}

// ---- segmentation folders -----------------------------------------------------------

SegmentationFolderDataset::SegmentationFolderDataset(const std::string& dir, int channels, int size)
    : dir_(dir), channels_(channels), size_(size) {
  const fs::path images = fs::path(dir) / "images";
  const fs::path masks = fs::path(dir) / "masks";
  HDDP_CHECK_AS(DataError, fs::is_directory(images) && fs::is_directory(masks),
                "segmentation folder ", dir, " needs images/ and masks/ subfolders");
  std::map<std::string, std::string> maskByStem;
  for (const auto& entry : fs::directory_iterator(masks)) {
    if (entry.is_regular_file() && isImageFile(entry.path())) {
      maskByStem[entry.path().stem().string()] = entry.path().string();
    }
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(images)) {
    if (entry.is_regular_file() && isImageFile(entry.path())) {
      names.push_back(entry.path().string());
    }
  }
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const std::string stem = fs::path(name).stem().string();
    auto it = maskByStem.find(stem);
    HDDP_CHECK_AS(DataError, it != maskByStem.end(), "segmentation folder ", dir, ": image ", name,
                  " has no mask named ", stem, ".* in ", masks.string());
    pairs_.emplace_back(name, it->second);
  }
  HDDP_CHECK_AS(DataError, !pairs_.empty(), "segmentation folder ", dir, " has no images");
  // Class count and the 0/255 binary convention, from the masks themselves.
  std::set<int64_t> values;
  for (const auto& pair : pairs_) {
    at::Tensor u = std::get<0>(at::_unique(decodeMask(pair.second, /*binary255=*/false)));
    for (int64_t i = 0; i < u.numel(); ++i) {
      values.insert(u[i].item<int64_t>());
    }
  }
  binary255_ = values.size() <= 2 && values.count(255) && (values.size() == 1 || values.count(0));
  classes_ = binary255_ ? 2 : std::max<int64_t>(2, *values.rbegin() + 1);
}

Example SegmentationFolderDataset::get(int64_t index, SampleRng& rng) const {
  HDDP_CHECK_AS(DataError, index >= 0 && index < size(), "segmentation sample ", index,
                " out of range");
  const auto& [imagePath, maskPath] = pairs_[static_cast<size_t>(index)];
  at::Tensor image = resizeImage(toFloatImage(decodeImage(imagePath, channels_)), size_);
  at::Tensor mask = resizeMask(decodeMask(maskPath, binary255_), size_);
  HDDP_CHECK_AS(DataError, mask.size(0) == image.size(1) && mask.size(1) == image.size(2), "mask ",
                maskPath, " is ", mask.size(1), "x", mask.size(0), " but image ", imagePath, " is ",
                image.size(2), "x", image.size(1));
  applyTransform(transform_, image, &mask, rng);
  return Example{image, mask};
}

std::string SegmentationFolderDataset::describe() const {
  std::ostringstream out;
  out << "segmentation folder " << dir_ << ": " << size() << " image/mask pairs, " << classes_
      << " classes" << (binary255_ ? " (binary 0/255 masks)" : "");
  return out.str();
}

// ---- subset ------------------------------------------------------------------------------

SubsetDataset::SubsetDataset(std::shared_ptr<const Dataset> base, int64_t offset, int64_t count)
    : base_(std::move(base)), offset_(offset), count_(count) {
  HDDP_CHECK_AS(DataError, base_ != nullptr, "SubsetDataset of a null dataset");
  HDDP_CHECK_AS(DataError, offset >= 0 && count > 0 && offset + count <= base_->size(), "subset [",
                offset, ", ", offset + count, ") outside a dataset of ", base_->size(), " samples");
}

Example SubsetDataset::get(int64_t index, SampleRng& rng) const {
  HDDP_CHECK_AS(DataError, index >= 0 && index < count_, "subset sample ", index, " out of range");
  return base_->get(offset_ + index, rng);
}

std::string SubsetDataset::describe() const {
  return base_->describe() + " (first " + std::to_string(count_) +
         (offset_ ? " from " + std::to_string(offset_) : "") + ")";
}

}  // namespace hddp
