// PNG through libpng (image_decode.h).
//
// libpng reports errors by longjmp to the setjmp of its caller. readPng below is the
// only function that calls setjmp, and it is written in C's manner: no object with a
// destructor lives in it or in the callbacks libpng calls, so the jump skips nothing
// (C++ makes a longjmp that would skip a non-trivial destructor undefined); everything
// it reports travels in a PngRead that the caller owns, the pixels in a malloc'd buffer
// that acceptDecoded (image_decode.cpp) frees on every path and turns into the tensor or
// a DataError.
//
// The samples come out as the file has them, expanded to 8 bits at least (palette to
// RGB or RGBA, 1, 2 and 4-bit gray to 8 bits, scaled as stb_image and Pillow scale them)
// and 16-bit ones kept, de-interlaced; toChannels then converts them as stb_image did.
// A mask's palette is not expanded: its indices are the class ids (toClassIds). Gamma,
// sRGB, ICC profiles and the background chunk are ignored, as stb_image ignored them;
// libpng's warnings (an incorrect sRGB profile is common) are not reported.
#include <ATen/core/Tensor.h>
#include <jpeglib.h>  // pngJpegDecoders: the version compiled against
#include <png.h>

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "data/image_decode.h"
#include "hddp/core/error.h"

namespace hddp {
namespace data {

namespace {

// What readPng reads from and reports; plain data only (see the top of the file).
struct PngRead {
  const unsigned char* data;
  size_t size;
  size_t offset;
  int64_t allowedPixels;  // refused beyond, before anything is allocated for the pixels
  bool classIds;          // a mask: palette indices kept
  DecodeResult result;
};

void pngFailed(png_structp png, png_const_charp message) {
  auto* read = static_cast<PngRead*>(png_get_error_ptr(png));
  std::snprintf(read->result.message, sizeof(read->result.message), "%s", message);
  png_longjmp(png, 1);
}

void pngWarned(png_structp, png_const_charp) {}  // a warning does not stop the decoding

void pngReadBytes(png_structp png, png_bytep out, size_t n) {
  auto* read = static_cast<PngRead*>(png_get_io_ptr(png));
  if (n > read->size - read->offset) {
    png_error(png, "the file ends inside the PNG (truncated)");
  }
  std::memcpy(out, read->data + read->offset, n);
  read->offset += n;
}

// Returns with read->result.status set; never throws.
void readPng(PngRead* read) {
  DecodeResult* const out = &read->result;
  out->status = DecodeResult::kFailed;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, read, pngFailed, pngWarned);
  if (png == nullptr) {
    std::snprintf(out->message, sizeof(out->message), "libpng could not start (out of memory)");
    return;
  }
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    std::snprintf(out->message, sizeof(out->message), "libpng could not start (out of memory)");
    return;
  }
  // png and info are not changed from here on: they keep their values after a longjmp.
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    return;
  }
  png_set_read_fn(png, read, pngReadBytes);
  png_read_info(png, info);
  out->width = png_get_image_width(png, info);
  out->height = png_get_image_height(png, info);
  if (static_cast<int64_t>(out->width) * out->height > read->allowedPixels) {
    out->status = DecodeResult::kTooLarge;
    png_destroy_read_struct(&png, &info, nullptr);
    return;
  }
  const int colorType = png_get_color_type(png, info);
  if (colorType == PNG_COLOR_TYPE_PALETTE && read->classIds) {
    png_set_packing(png);  // indices of 1, 2 and 4 bits to a byte each, not scaled
  } else if (colorType == PNG_COLOR_TYPE_PALETTE) {
    png_set_palette_to_rgb(png);  // and tRNS to alpha, which toChannels drops
  }
  if (colorType == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(png, info) < 8) {
    if (read->classIds) {
      png_set_packing(png);  // a mask's ids of 1, 2 and 4 bits, not scaled (as a palette's)
    } else {
      png_set_expand_gray_1_2_4_to_8(png);  // scaled: 1 -> 255, as stb_image scales
    }
  }
  const int passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  out->channels = png_get_channels(png, info);
  out->bits = png_get_bit_depth(png, info);
  const size_t rowBytes = png_get_rowbytes(png, info);
  if (out->channels < 1 || out->channels > 4 || (out->bits != 8 && out->bits != 16) ||
      rowBytes != static_cast<size_t>(out->width) * out->channels * (out->bits / 8)) {
    png_error(png, "unexpected layout after libpng's transformations");
  }
  // At most allowedPixels (< 2^31) x 8 bytes.
  out->pixels = static_cast<unsigned char*>(std::malloc(rowBytes * out->height));
  if (out->pixels == nullptr) {
    png_error(png, "out of memory for the pixels");
  }
  for (int pass = 0; pass < passes; ++pass) {
    for (png_uint_32 y = 0; y < out->height; ++y) {
      png_read_row(png, out->pixels + y * rowBytes, nullptr);
    }
  }
  // The chunks after the image data (png_read_end) are not read: nothing there changes
  // the pixels, and stb_image did not read them either.
  png_destroy_read_struct(&png, &info, nullptr);
  out->status = DecodeResult::kDecoded;
}

}  // namespace

at::Tensor decodePng(const std::string& bytes, const std::string& path,
                     const DecodeRequest& request) {
  PngRead read{};
  read.data = reinterpret_cast<const unsigned char*>(bytes.data());
  read.size = bytes.size();
  read.allowedPixels = allowedPixels(kPng, bytes.size(), request.limits);
  read.classIds = request.classIds;
  readPng(&read);
  return acceptDecoded(read.result, path, kPng, bytes.size(), request);
}

std::string pngJpegDecoders() {
  std::string jpeg = "libjpeg";
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
  constexpr int kTurbo = LIBJPEG_TURBO_VERSION_NUMBER;  // 2001005 for 2.1.5
  jpeg = "libjpeg-turbo " + std::to_string(kTurbo / 1000000) + "." +
         std::to_string(kTurbo / 1000 % 1000) + "." + std::to_string(kTurbo % 1000);
#endif
  return "libpng " PNG_LIBPNG_VER_STRING ", " + jpeg + " (libjpeg API " +
         std::to_string(JPEG_LIB_VERSION) + ")";
}

}  // namespace data
}  // namespace hddp
