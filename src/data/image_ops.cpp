// Image operations: the image file names, resizing, masks, the training transform.
// Decoding: image_decode.cpp and the decoders it names.
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <random>
#include <set>

#include "data/image_decode.h"
#include "data/image_io.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"

namespace fs = std::filesystem;

namespace hddp {
namespace data {

bool isImageFile(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  static const std::set<std::string> known{".png", ".jpg", ".jpeg", ".bmp",
                                           ".tga", ".gif", ".pgm",  ".ppm"};
  return known.count(ext) > 0;
}

at::Tensor toFloatImage(const at::Tensor& u8) { return u8.to(at::kFloat).div_(255.0f); }

// [C, H, W] float -> size x size (bilinear), or as is.
at::Tensor resizeImage(const at::Tensor& image, int size) {
  if (size <= 0 || (image.size(1) == size && image.size(2) == size)) {
    return image;
  }
  namespace F = torch::nn::functional;
  return F::interpolate(image.unsqueeze(0), F::InterpolateFuncOptions()
                                                .size(std::vector<int64_t>{size, size})
                                                .mode(torch::kBilinear)
                                                .align_corners(false))
      .squeeze(0);
}

at::Tensor resizeMask(const at::Tensor& mask, int size) {
  if (size <= 0 || (mask.size(0) == size && mask.size(1) == size)) {
    return mask;
  }
  namespace F = torch::nn::functional;
  return F::interpolate(mask.to(at::kFloat).unsqueeze(0).unsqueeze(0),
                        F::InterpolateFuncOptions()
                            .size(std::vector<int64_t>{size, size})
                            .mode(torch::kNearest))
      .squeeze(0)
      .squeeze(0)
      .to(at::kLong);
}

at::Tensor decodeMask(const std::string& path, bool binary255) {
  DecodeRequest request;
  request.classIds = true;
  at::Tensor mask = decodeFile(path, request).squeeze(0).to(at::kLong);
  if (binary255) {
    mask = (mask > 0).to(at::kLong);
  }
  return mask;
}

}  // namespace data

// ---- transform -------------------------------------------------------------------

void applyTransform(const ImageTransform& transform, at::Tensor& image, at::Tensor* mask,
                    SampleRng& rng) {
  const int64_t h = image.size(1);
  const int64_t w = image.size(2);
  if (transform.padCrop > 0) {
    const int64_t p = transform.padCrop;
    std::uniform_int_distribution<int64_t> offset(0, 2 * p);
    const int64_t dy = offset(rng);
    const int64_t dx = offset(rng);
    image = at::constant_pad_nd(image, {p, p, p, p}, 0).narrow(1, dy, h).narrow(2, dx, w);
    if (mask != nullptr && mask->defined()) {
      *mask = at::constant_pad_nd(*mask, {p, p, p, p}, 0).narrow(0, dy, h).narrow(1, dx, w);
    }
  }
  if (transform.horizontalFlip) {
    std::bernoulli_distribution flip(0.5);
    if (flip(rng)) {
      image = image.flip({2});
      if (mask != nullptr && mask->defined()) {
        *mask = mask->flip({1});
      }
    }
  }
  if (!transform.mean.empty()) {
    const int64_t c = image.size(0);
    HDDP_CHECK_AS(DataError,
                  static_cast<int64_t>(transform.mean.size()) == c &&
                      static_cast<int64_t>(transform.std.size()) == c,
                  "ImageTransform has ", transform.mean.size(), " means and ", transform.std.size(),
                  " stds for an image of ", c, " channels");
    auto mean = at::tensor(transform.mean).view({c, 1, 1});
    auto std = at::tensor(transform.std).view({c, 1, 1});
    image = (image - mean) / std;
  }
  image = image.contiguous();
  if (mask != nullptr && mask->defined()) {
    *mask = mask->contiguous();
  }
}

}  // namespace hddp
