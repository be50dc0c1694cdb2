// Image operations: decoding (stb_image), resizing, the training transform.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "data/image_io.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_FAILURE_USERMSG
// The formats hddp reads (isImageFile) and no others: less of stb_image to trust.
#define STBI_NO_PSD
#define STBI_NO_HDR
#define STBI_NO_PIC
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include <stb/stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

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

}  // namespace data

using data::toFloatImage;

namespace {

std::string stbReason() { return stbi_failure_reason() ? stbi_failure_reason() : "unknown error"; }

// An image format, told by its first bytes as stb_image tells it, and the most pixels a
// legitimate file of it describes per byte. stb_image allocates (and for GIF, BMP, TGA and
// JPEG clears or decodes) the whole size a header claims, filling what the data lacks
// with zeros: a 29-byte GIF made it take 4 GB.
struct ImageFormat {
  const char* name;
  int64_t pixelsPerByte;
};

// Where a JPEG's segments begin (after its SOI marker), or 0 for no JPEG: stb_image takes
// fill bytes (0xFF) before the SOI too.
size_t jpegSegments(const std::string& b) {
  size_t i = 0;
  while (i < b.size() && static_cast<unsigned char>(b[i]) == 0xFF) {
    ++i;
  }
  return i > 0 && i < b.size() && static_cast<unsigned char>(b[i]) == 0xD8 ? i + 1 : 0;
}

ImageFormat formatOf(const std::string& b) {
  const auto starts = [&b](const char* magic, size_t n) {
    return b.size() >= n && b.compare(0, n, magic, n) == 0;
  };
  if (starts("\x89PNG\r\n\x1a\n", 8)) {
    return {"PNG", 8256};  // deflate expands at most 1032:1, a pixel takes a bit at least
  }
  if (jpegSegments(b) > 0) {
    // A scan codes each 8x8 block of a component in a bit at least, and a component is
    // subsampled 4x4 at most.
    return {"JPEG", 8192};
  }
  if (starts("GIF8", 4)) {
    return {"GIF", 2731};  // an LZW code of 12 bits yields 4096 pixels at most
  }
  if (starts("BM", 2)) {
    return {"BMP", 8};  // a bit a pixel at least (stb_image reads no run-length BMP)
  }
  if (starts("P5", 2) || starts("P6", 2)) {
    return {"PGM/PPM", 1};  // a byte a sample
  }
  return {"TGA", 64};  // a run of 128 pixels takes 2 bytes at least
}

// Debian's stb_image (2.27) builds a JPEG Huffman table from the 16 counts of a DHT
// segment without checking that they count 256 codes at most, and writes past its table
// when they do (nothings/stb#1291, fixed in 2.28); stbi_info already does. Every DHT
// segment is read here first, wherever it stands (progressive JPEGs have them between
// scans), as stb_image reads it: bytes past the end of the file count as zeros.
void checkJpegHuffmanTables(const std::string& b, const std::string& path) {
  const auto at = [&b](size_t i) -> size_t {
    return i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
  };
  for (size_t pos = jpegSegments(b); pos + 1 < b.size();) {
    const size_t marker = at(pos + 1);
    if (at(pos) != 0xFF || marker == 0xFF) {
      ++pos;  // entropy-coded data, or a fill byte before a marker
      continue;
    }
    if (marker == 0x00 || marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) {
      pos += 2;  // a stuffed 0xFF, TEM, RSTn, SOI: no length follows
      continue;
    }
    if (marker == 0xD9) {  // EOI
      return;
    }
    const size_t length = (at(pos + 2) << 8) | at(pos + 3);  // counting itself
    const size_t end = pos + 2 + std::max<size_t>(length, 2);
    for (size_t table = pos + 4; marker == 0xC4 && table < end;) {
      size_t codes = 0;
      for (size_t k = 1; k <= 16; ++k) {
        codes += at(table + k);
      }
      HDDP_CHECK_AS(DataError, codes <= 256, "cannot decode image ", path,
                    ": its JPEG Huffman table (DHT segment at byte ", pos, ") counts ", codes,
                    " codes, more than the 256 a table holds: the file is damaged or crafted");
      table += 17 + codes;
    }
    pos = end;
  }
}

// What decodeImage refuses before stb_image decodes `bytes` into `channels`.
void checkImageBeforeDecoding(const std::string& bytes, const std::string& path, int channels,
                              const ImageLimits& limits) {
  HDDP_CHECK_AS(DataError, bytes.size() <= static_cast<size_t>(std::numeric_limits<int>::max()),
                "image ", path, " has ", bytes.size(), " bytes, more than stb_image reads (2 GiB)");
  const ImageFormat format = formatOf(bytes);
  if (std::string(format.name) == "JPEG") {
    checkJpegHuffmanTables(bytes, path);
  }
  int w = 0;
  int h = 0;
  int n = 0;
  HDDP_CHECK_AS(DataError,
                stbi_info_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()),
                                      static_cast<int>(bytes.size()), &w, &h, &n) == 1,
                "cannot decode image ", path, ": ", stbReason());
  const int64_t pixels = static_cast<int64_t>(w) * h;
  const int64_t describable = format.pixelsPerByte * static_cast<int64_t>(bytes.size());
  HDDP_CHECK_AS(DataError, pixels <= describable, "cannot decode image ", path, ": it claims ", w,
                "x", h, " pixels, more than its ", bytes.size(), " bytes can describe as ",
                format.name, " (", format.pixelsPerByte,
                " pixels a byte at most): the file is damaged or crafted");
  HDDP_CHECK_AS(DataError, pixels <= limits.maxPixels, "image ", path, " is ", w, "x", h, " (",
                pixels, " pixels), more than the limit of ", limits.maxPixels,
                " pixels (ImageLimits::maxPixels)");
  // stb_image 2.27 converts a 16-bit PGM/PPM to other channels as if it had 8 bits, then
  // reads twice the buffer it made (fixed in 2.28).
  HDDP_CHECK_AS(DataError,
                std::string(format.name) != "PGM/PPM" || n == channels ||
                    !stbi_is_16_bit_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()),
                                                static_cast<int>(bytes.size())),
                "cannot decode image ", path, ": a 16-bit ", n == 1 ? "PGM" : "PPM", " read as ",
                channels,
                " channel(s), which Debian's stb_image 2.27 converts past "
                "its buffer; save it with 8 bits, or with ",
                channels, " channel(s)");
}

}  // namespace

at::Tensor decodeImage(const std::string& path, int channels, const ImageLimits& limits) {
  HDDP_CHECK_AS(DataError, channels == 1 || channels == 3,
                "decodeImage: channels must be 1 or 3, got ", channels);
  std::ifstream in(path, std::ios::binary);
  HDDP_CHECK_AS(DataError, in.good(), "cannot open image ", path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  checkImageBeforeDecoding(bytes, path, channels, limits);
  int w = 0;
  int h = 0;
  int n = 0;
  unsigned char* pixels =
      stbi_load_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()),
                            static_cast<int>(bytes.size()), &w, &h, &n, channels);
  HDDP_CHECK_AS(DataError, pixels != nullptr, "cannot decode image ", path, ": ", stbReason());
  at::Tensor hwc = at::from_blob(pixels, {h, w, channels}, at::kByte).clone();
  stbi_image_free(pixels);
  return hwc.permute({2, 0, 1}).contiguous();
}

namespace data {

at::Tensor decodeMask(const std::string& path, bool binary255) {
  at::Tensor mask = decodeImage(path, 1).squeeze(0).to(at::kLong);
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
