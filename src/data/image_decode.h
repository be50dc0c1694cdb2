// Image decoding behind hddp::decodeImage and the masks' data::decodeMask
// (image_decode.cpp), one decoder a format:
//
//   PNG       libpng (image_png.cpp)
//   JPEG      libjpeg-turbo (image_jpeg.cpp)
//   PGM/PPM   hddp's own reader of binary P5/P6 (image_pnm.cpp)
//   GIF, BMP, TGA   stb_image, with its other loaders compiled out (image_stb.cpp)
//
// A build without libpng or libjpeg (a GPU machine with no package access, built with
// HDDP_DEVICE_DEPS) compiles image_png_jpeg_stb.cpp instead of the first two, and
// image_stb.cpp with HDDP_STB_PNG_JPEG: PNG and JPEG through stb_image, as hddp did before.
//
// Every decoder reads the width and height first and calls checkImagePixels before it
// allocates anything for the pixels. An image is converted to the channels asked as
// stb_image converts (toChannels), so that a PNG, a PGM or a BMP decodes to the same
// pixels whichever decoder reads it; a mask keeps the numbers the file stores
// (toClassIds): a palette PNG's indices, a gray value.
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

/// [1, H, W] uint8 class ids from a mask's `samples`: gray (alpha dropped) as it is, RGB
/// or RGBA whose three colors are equal in every pixel (gray stored as RGB) as that value.
/// hddp::DataError naming `path` and the pixel for RGB whose colors differ (masks hold
/// class ids in one channel: a palette PNG's indices or gray) and for a 16-bit value
/// above 255.
at::Tensor toClassIds(const Samples& samples, const std::string& path);

/// What a decoder is asked for.
struct DecodeRequest {
  /// An image's channels: 1 or 3, converted by toChannels. Not used for a mask.
  int channels = 3;
  /// A mask: [1, H, W] class ids as the file stores them (toClassIds), not an image.
  bool classIds = false;
  ImageLimits limits;
};

/// toClassIds or toChannels, as `request` asks.
at::Tensor toRequested(const Samples& samples, const DecodeRequest& request,
                       const std::string& path);

/// What a decoder written in C's manner reports (readPng, readJpeg: libpng and libjpeg
/// report errors by longjmp, which must skip no destructor): plain data only.
struct DecodeResult {
  enum Status { kFailed, kTooLarge, kTruncated, kDecoded } status;
  uint32_t width;
  uint32_t height;
  int channels;           // in `pixels`, interleaved
  int bits;               // 8, or 16 big-endian
  unsigned char* pixels;  // malloc'd; acceptDecoded frees it
  char message[256];      // why it failed (kFailed, kTruncated), in the decoder's words
  int warnings;           // how many the decoder gave while it went on
  char warning[256];      // the first of them
};

/// The tensor `request` asks for from `result`, which the decoder of `format` made from
/// `fileBytes` bytes of `path`; frees result.pixels on every path. hddp::DataError naming
/// `path` when the image is larger than allowed, truncated or failed; a decoder's
/// warnings are logged, once per file and process.
at::Tensor acceptDecoded(DecodeResult& result, const std::string& path, const ImageFormat& format,
                         size_t fileBytes, const DecodeRequest& request);

/// The decoders. `bytes` is the whole file, at most 2 GiB (decodeFile checks); each
/// throws hddp::DataError naming `path` and what is wrong.
at::Tensor decodePng(const std::string& bytes, const std::string& path,
                     const DecodeRequest& request);
/// `soi`: where the JPEG's SOI marker (0xFF 0xD8) begins; fill bytes (0xFF) may come
/// before it, which stb_image skipped too.
at::Tensor decodeJpeg(const std::string& bytes, size_t soi, const std::string& path,
                      const DecodeRequest& request);
at::Tensor decodePnm(const std::string& bytes, const std::string& path,
                     const DecodeRequest& request);
/// Through stb_image: GIF, BMP and TGA (`format` from the first bytes; a file no other
/// decoder claims is tried as TGA, as stb_image does), and PNG and JPEG in the fallback
/// build. An image's channels are converted by stb_image; a mask gets the channels the
/// file has (stb_image expands a GIF's, a BMP's or a TGA's palette to RGB: such a mask
/// must have a gray palette).
at::Tensor decodeWithStb(const std::string& bytes, const std::string& path,
                         const ImageFormat& format, const DecodeRequest& request);

/// Reads `path` and hands it to the decoder its first bytes name (decodeImage, decodeMask).
at::Tensor decodeFile(const std::string& path, const DecodeRequest& request);

/// What decodes PNG and JPEG in this build, with the versions compiled against, for
/// messages and tests: "libpng 1.6.39, libjpeg-turbo 2.1.5 (libjpeg API 62)" or
/// "stb_image (fallback)".
std::string pngJpegDecoders();

}  // namespace data
}  // namespace hddp
