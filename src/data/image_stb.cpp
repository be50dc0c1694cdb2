// GIF, BMP and TGA through stb_image (image_decode.h): Debian's libstb-dev (2.27), with
// every loader hddp does not use compiled out (PNG, JPEG and PGM/PPM have decoders of
// their own; PSD, HDR and PIC are not read) and its functions static, not exported from
// libhddp. 17.5 minutes of fuzz_image (2026-12-07) found no fault in these three
// loaders but the size a header claims (finding 16: a top-down BMP's negative height),
// which is checked first (checkImagePixels, on the sizes' absolute values).
//
// The one translation unit that holds stb_image. The build without libpng or libjpeg
// (src/CMakeLists.txt) compiles it with HDDP_STB_PNG_JPEG, which keeps stb_image's PNG and
// JPEG loaders too, for image_png_jpeg_stb.cpp.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "data/image_decode.h"
#include "hddp/core/error.h"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_FAILURE_USERMSG
#define STBI_NO_STDIO
#define STBI_NO_LINEAR
#ifndef HDDP_STB_PNG_JPEG
#define STBI_NO_PNG
#define STBI_NO_JPEG
#endif
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

std::string stbReason() {
  const char* reason = stbi_failure_reason();
  return reason != nullptr ? reason : "unknown error";
}

// stb_image's pixels, freed with stbi_image_free.
using StbPixels = std::unique_ptr<void, decltype(&stbi_image_free)>;

}  // namespace

at::Tensor decodeWithStb(const std::string& bytes, const std::string& path,
                         const ImageFormat& format, const DecodeRequest& request) {
  const auto* data = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int size = static_cast<int>(bytes.size());  // <= 2 GiB: decodeFile checks
  int w = 0;
  int h = 0;
  int n = 0;
  HDDP_CHECK_AS(DataError, stbi_info_from_memory(data, size, &w, &h, &n) == 1,
                "cannot decode image ", path, ": ", stbReason(),
                " (hddp reads PNG, JPEG, GIF, BMP, TGA and binary PGM/PPM)");
  // A BMP stored top-down has a negative height, which stbi_info passes on as it is.
  checkImagePixels(path, format, std::abs(int64_t{w}), std::abs(int64_t{h}), bytes.size(),
                   request.limits);
  // A mask gets the channels the file has (0: as they are); an image, those asked.
  const int wanted = request.classIds ? 0 : request.channels;
  // A 16-bit PNG (the fallback build) keeps its 16 bits in a mask.
  const bool sixteen = request.classIds && stbi_is_16_bit_from_memory(data, size) == 1;
  StbPixels pixels(
      sixteen ? static_cast<void*>(stbi_load_16_from_memory(data, size, &w, &h, &n, wanted))
              : static_cast<void*>(stbi_load_from_memory(data, size, &w, &h, &n, wanted)),
      &stbi_image_free);
  HDDP_CHECK_AS(DataError, pixels != nullptr, "cannot decode image ", path, ": ", stbReason());
  Samples samples;
  samples.data = static_cast<const uint8_t*>(pixels.get());
  samples.width = w;
  samples.height = h;
  samples.channels = wanted != 0 ? wanted : n;  // stb_image converted an image's already
  std::vector<uint8_t> bigEndian;
  if (sixteen) {  // stb_image's native-endian samples as Samples holds them
    const auto* native = static_cast<const uint16_t*>(pixels.get());
    bigEndian.resize(static_cast<size_t>(w) * h * samples.channels * 2);
    for (size_t i = 0; i < bigEndian.size() / 2; ++i) {
      bigEndian[2 * i] = static_cast<uint8_t>(native[i] >> 8);
      bigEndian[2 * i + 1] = static_cast<uint8_t>(native[i] & 0xff);
    }
    samples.data = bigEndian.data();
    samples.bits = 16;
  }
  return toRequested(samples, request, path);
}

}  // namespace data
}  // namespace hddp
