// Image decoding behind hddp::decodeImage (image_decode.cpp), one decoder a format:
//
//   PNG       libpng (image_png.cpp)
//   JPEG      libjpeg-turbo (image_jpeg.cpp)
//   PGM/PPM   hddp's own reader of binary P5/P6 (image_pnm.cpp)
//   GIF, BMP, TGA   stb_image, with its other loaders compiled out (image_stb.cpp)
//
// A build without libpng or libjpeg (a GPU machine with no package access, built with
// HDDP_DEVICE_DEPS) compiles image_png_jpeg_stb.cpp instead of the first two: PNG and
// JPEG through stb_image, as hddp did before.
//
// Every decoder reads the width and height first and calls checkImagePixels before it
// allocates anything for the pixels, and converts to the channels asked as stb_image does
// (toChannels), so that a PNG, a PGM or a BMP decodes to the same pixels whichever
// decoder reads it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "hddp/data/datasets.h"

namespace hddp {
namespace data {

/// What a file's format lets it describe: the most pixels a legitimate file of it codes
/// per byte. A decoder (stb_image, libjpeg too) fills what the data lacks with zeros, so
/// without this a 29-byte GIF made hddp allocate and clear 4 GB.
struct ImageFormat {
  const char* name;
  int64_t pixelsPerByte;
};
inline constexpr ImageFormat kPng{"PNG", 8256};  // deflate expands at most 1032:1, a pixel
                                                 // takes a bit at least
// A scan codes each 8x8 block of a component in a bit at least, and a component is
// subsampled 4x4 at most.
inline constexpr ImageFormat kJpeg{"JPEG", 8192};
inline constexpr ImageFormat kGif{"GIF", 2731};   // an LZW code of 12 bits: 4096 pixels at most
inline constexpr ImageFormat kBmp{"BMP", 8};      // a bit a pixel (stb_image reads no RLE BMP)
inline constexpr ImageFormat kPnm{"PGM/PPM", 1};  // a byte a sample at least
inline constexpr ImageFormat kTga{"TGA", 64};     // a run of 128 pixels takes 2 bytes at least

/// The most pixels an image of `format` in `fileBytes` bytes may have under `limits`.
int64_t allowedPixels(const ImageFormat& format, size_t fileBytes, const ImageLimits& limits);

/// hddp::DataError naming `path`, the size and the limit it passes (what the file's bytes
/// can describe, or ImageLimits::maxPixels), unless width x height is within both.
void checkImagePixels(const std::string& path, const ImageFormat& format, int64_t width,
                      int64_t height, size_t fileBytes, const ImageLimits& limits);

/// Decoded samples, row after row, `channels` (1 gray, 2 gray + alpha, 3 RGB, 4 RGBA)
/// interleaved; 8 bits a sample, or 16 bits big-endian (as PNG and PGM/PPM store them).
struct Samples {
  const uint8_t* data = nullptr;
  int64_t width = 0;
  int64_t height = 0;
  int channels = 0;
  int bits = 8;
};

/// [channels, H, W] uint8 from `samples`, converted as stb_image converts: gray to RGB
/// by copying, RGB to gray as (77 R + 150 G + 29 B) >> 8, alpha dropped; 16-bit samples
/// converted in 16 bits, then their high byte kept.
at::Tensor toChannels(const Samples& samples, int channels);

/// The decoders. `bytes` is the whole file, at most 2 GiB (decodeImage checks); each
/// throws hddp::DataError naming `path` and what is wrong.
at::Tensor decodePng(const std::string& bytes, const std::string& path, int channels,
                     const ImageLimits& limits);
/// `soi`: where the JPEG's SOI marker (0xFF 0xD8) begins; fill bytes (0xFF) may come
/// before it, which stb_image skipped too.
at::Tensor decodeJpeg(const std::string& bytes, size_t soi, const std::string& path, int channels,
                      const ImageLimits& limits);
at::Tensor decodePnm(const std::string& bytes, const std::string& path, int channels,
                     const ImageLimits& limits);
/// GIF, BMP and TGA (a file no other decoder claims is tried as TGA, as stb_image does).
at::Tensor decodeWithStb(const std::string& bytes, const std::string& path, int channels,
                         const ImageLimits& limits);

/// What decodes PNG and JPEG in this build, for messages and tests: "libpng 1.6.39,
/// libjpeg-turbo 2.1.5 (libjpeg API 62)" or "stb_image (fallback)".
std::string pngJpegDecoders();

}  // namespace data
}  // namespace hddp
