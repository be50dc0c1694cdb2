// GIF, BMP and TGA through stb_image (image_decode.h): Debian's libstb-dev (2.27), with
// every loader hddp does not use compiled out (PNG, JPEG and PGM/PPM have decoders of
// their own; PSD, HDR and PIC are not read) and its functions static, not exported from
// libhddp. 17.5 minutes of fuzz_image (2026-12-07) found no fault in these three
// loaders but the size a header claims (finding 16: a top-down BMP's negative height),
// which is checked first (checkImagePixels, on the sizes' absolute values).
#include <ATen/core/Tensor.h>

#include <cstdlib>
#include <string>

#include "data/image_decode.h"
#include "hddp/core/error.h"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_FAILURE_USERMSG
#define STBI_NO_STDIO
#define STBI_NO_LINEAR
#define STBI_NO_PNG
#define STBI_NO_JPEG
#define STBI_NO_PNM
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

namespace hddp {
namespace data {

namespace {

std::string stbReason() { return stbi_failure_reason() ? stbi_failure_reason() : "unknown error"; }

// The format stb_image takes the bytes for: GIF, BMP, or else TGA (whose header has no
// magic: stb_image tries it last).
const ImageFormat& stbFormat(const std::string& b) {
  if (b.size() >= 4 && b.compare(0, 4, "GIF8") == 0) {
    return kGif;
  }
  if (b.size() >= 2 && b.compare(0, 2, "BM") == 0) {
    return kBmp;
  }
  return kTga;
}

}  // namespace

at::Tensor decodeWithStb(const std::string& bytes, const std::string& path, int channels,
                         const ImageLimits& limits) {
  const auto* data = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int size = static_cast<int>(bytes.size());  // <= 2 GiB: decodeImage checks
  int w = 0;
  int h = 0;
  int n = 0;
  HDDP_CHECK_AS(DataError, stbi_info_from_memory(data, size, &w, &h, &n) == 1,
                "cannot decode image ", path, ": ", stbReason(),
                " (hddp reads PNG, JPEG, GIF, BMP, TGA and binary PGM/PPM)");
  // A BMP stored top-down has a negative height, which stbi_info passes on as it is.
  checkImagePixels(path, stbFormat(bytes), std::abs(int64_t{w}), std::abs(int64_t{h}), bytes.size(),
                   limits);
  stbi_uc* pixels = stbi_load_from_memory(data, size, &w, &h, &n, channels);
  HDDP_CHECK_AS(DataError, pixels != nullptr, "cannot decode image ", path, ": ", stbReason());
  Samples samples;
  samples.data = pixels;
  samples.width = w;
  samples.height = h;
  samples.channels = channels;  // stb_image converted them already
  at::Tensor image;
  try {
    image = toChannels(samples, channels);
  } catch (...) {
    stbi_image_free(pixels);
    throw;
  }
  stbi_image_free(pixels);
  return image;
}

}  // namespace data
}  // namespace hddp
