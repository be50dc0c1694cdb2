// JPEG through libjpeg-turbo (image_decode.h).
//
// libjpeg's default error handler calls exit(); hddp's error_exit longjmps to readJpeg,
// the only function here that calls setjmp. As in image_png.cpp it is written in C's
// manner: no object with a destructor lives in it or in the callbacks libjpeg calls, so
// the jump skips nothing; all it reports travels in a JpegRead the caller owns, and the
// pixels in a malloc'd buffer the caller frees on every path. Warnings (corrupt or
// truncated entropy-coded data, which libjpeg fills in) are not printed and do not stop
// the decoding, as stb_image, which hddp used before, decoded such files too.
//
// Pixels are libjpeg-turbo's defaults (accurate integer IDCT, smooth chroma upsampling),
// equal to Pillow's: they differ from stb_image's by up to 3 levels, and by more in one
// column of a 4:2:2 image, where stb_image 2.27 swaps its chroma weights
// (tests/data/image_decode_test.cpp). Channels are chosen as stb_image chose them: one
// channel of a YCbCr JPEG is its Y plane, one of an RGB JPEG is (77 R + 150 G + 29 B) >> 8,
// CMYK and YCCK become RGB by multiplying each of C, M, Y by K (stbi__blinn_8x8).
#include <ATen/core/Tensor.h>
#include <jpeglib.h>

#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE and size_t declared first
#include <cstdlib>
#include <string>

#include "data/image_decode.h"
#include "hddp/core/error.h"

namespace hddp {
namespace data {

namespace {

// A progressive JPEG may have any number of scans, each a pass over the coefficients:
// a crafted file of many tiny scans takes minutes. A real one has about 10.
constexpr int kMaxScans = 1000;

// What readJpeg reads from and reports; plain data only (see the top of the file).
struct JpegRead {
  const unsigned char* data;
  size_t size;
  bool gray;  // one channel wanted
  int64_t allowedPixels;
  enum Status { kDecoded, kFailed, kTooLarge } status;
  JDIMENSION width;
  JDIMENSION height;
  J_COLOR_SPACE colorSpace;  // the file's
  J_COLOR_SPACE outSpace;    // what libjpeg delivered
  int components;            // in `pixels`, interleaved
  unsigned char* pixels;     // malloc'd; the caller frees it
  char message[JMSG_LENGTH_MAX];
  // libjpeg's state lives here too, not in readJpeg: C leaves a local that changed
  // between setjmp and longjmp indeterminate after the jump.
  jpeg_decompress_struct jpeg;
  jpeg_error_mgr errors;
  jpeg_progress_mgr progress;
  jmp_buf jump;
};

void jpegFailed(j_common_ptr common) {
  auto* read = static_cast<JpegRead*>(common->client_data);
  (*common->err->format_message)(common, read->message);
  std::longjmp(read->jump, 1);
}

void jpegMessage(j_common_ptr) {}  // warnings and traces: not printed

void jpegProgress(j_common_ptr common) {
  auto* read = static_cast<JpegRead*>(common->client_data);
  if (reinterpret_cast<j_decompress_ptr>(common)->input_scan_number > kMaxScans) {
    std::snprintf(read->message, sizeof(read->message),
                  "it has more than %d scans (a real JPEG has about 10)", kMaxScans);
    std::longjmp(read->jump, 1);
  }
}

// The output libjpeg is asked for (outSpace), from the file's color space.
bool chooseOutput(j_decompress_ptr jpeg, JpegRead* read) {
  switch (jpeg->jpeg_color_space) {
    case JCS_GRAYSCALE:
      jpeg->out_color_space = JCS_GRAYSCALE;
      return true;
    case JCS_YCbCr:
      jpeg->out_color_space = read->gray ? JCS_GRAYSCALE : JCS_RGB;  // gray: the Y plane
      return true;
    case JCS_RGB:
      jpeg->out_color_space = JCS_RGB;
      return true;
    case JCS_CMYK:
      jpeg->out_color_space = JCS_CMYK;
      return true;
    case JCS_YCCK:  // gray: Y and K; RGB: libjpeg's inverted RGB (its CMYK) and K
      jpeg->out_color_space = read->gray ? JCS_YCCK : JCS_CMYK;
      return true;
    default:
      return false;
  }
}

// Returns with read->status set; never throws. `read` comes zeroed.
void readJpeg(JpegRead* read) {
  read->status = JpegRead::kFailed;
  jpeg_decompress_struct* jpeg = &read->jpeg;
  jpeg->err = jpeg_std_error(&read->errors);
  read->errors.error_exit = jpegFailed;
  read->errors.output_message = jpegMessage;
  jpeg->client_data = read;  // kept by jpeg_create_decompress, which may fail already
  if (setjmp(read->jump)) {
    jpeg_destroy_decompress(jpeg);  // safe on a zeroed or partly made object
    return;
  }
  jpeg_create_decompress(jpeg);
  read->progress.progress_monitor = jpegProgress;
  jpeg->progress = &read->progress;
  jpeg_mem_src(jpeg, read->data, static_cast<unsigned long>(read->size));
  jpeg_read_header(jpeg, TRUE);
  read->width = jpeg->image_width;
  read->height = jpeg->image_height;
  read->colorSpace = jpeg->jpeg_color_space;
  if (static_cast<int64_t>(read->width) * read->height > read->allowedPixels) {
    read->status = JpegRead::kTooLarge;
    jpeg_destroy_decompress(jpeg);
    return;
  }
  if (!chooseOutput(jpeg, read)) {
    std::snprintf(read->message, sizeof(read->message),
                  "it has %d components in no color space hddp converts (libjpeg's "
                  "J_COLOR_SPACE %d)",
                  jpeg->num_components, static_cast<int>(jpeg->jpeg_color_space));
    jpeg_destroy_decompress(jpeg);
    return;
  }
  read->outSpace = jpeg->out_color_space;
  jpeg_start_decompress(jpeg);
  read->components = jpeg->output_components;
  const size_t rowBytes = static_cast<size_t>(jpeg->output_width) * jpeg->output_components;
  // At most allowedPixels (< 2^31) x 4 bytes.
  read->pixels = static_cast<unsigned char*>(std::malloc(rowBytes * jpeg->output_height));
  if (read->pixels == nullptr) {
    std::snprintf(read->message, sizeof(read->message), "out of memory for the pixels");
    jpeg_destroy_decompress(jpeg);
    return;
  }
  while (jpeg->output_scanline < jpeg->output_height) {
    JSAMPROW row = read->pixels + jpeg->output_scanline * rowBytes;
    jpeg_read_scanlines(jpeg, &row, 1);
  }
  // Not jpeg_finish_decompress: what follows the last scan changes no pixel.
  jpeg_destroy_decompress(jpeg);
  read->status = JpegRead::kDecoded;
}

// stbi__blinn_8x8: x * y / 255, rounded.
inline unsigned char blinn(unsigned x, unsigned y) {
  const unsigned t = x * y + 128;
  return static_cast<unsigned char>((t + (t >> 8)) >> 8);
}

}  // namespace

at::Tensor decodeJpeg(const std::string& bytes, size_t soi, const std::string& path, int channels,
                      const ImageLimits& limits) {
  JpegRead read{};
  read.data = reinterpret_cast<const unsigned char*>(bytes.data()) + soi;
  read.size = bytes.size() - soi;
  read.gray = channels == 1;
  read.allowedPixels = allowedPixels(kJpeg, bytes.size(), limits);
  readJpeg(&read);
  struct FreePixels {
    unsigned char* p;
    ~FreePixels() { std::free(p); }
  } owner{read.pixels};
  if (read.status == JpegRead::kTooLarge) {
    checkImagePixels(path, kJpeg, read.width, read.height, bytes.size(), limits);
  }
  HDDP_CHECK_AS(DataError, read.status == JpegRead::kDecoded, "cannot decode image ", path,
                " (JPEG): ", read.message);
  Samples samples;
  samples.data = read.pixels;
  samples.width = read.width;
  samples.height = read.height;
  samples.channels = read.components;
  const size_t pixels = static_cast<size_t>(read.width) * read.height;
  unsigned char* p = read.pixels;
  if (read.outSpace == JCS_CMYK) {  // to RGB in place: C, M, Y times K
    for (size_t i = 0; i < pixels; ++i) {
      const unsigned k = p[4 * i + 3];
      p[3 * i] = blinn(p[4 * i], k);
      p[3 * i + 1] = blinn(p[4 * i + 1], k);
      p[3 * i + 2] = blinn(p[4 * i + 2], k);
    }
    samples.channels = 3;
  } else if (read.outSpace == JCS_YCCK) {  // to gray in place: (255 - Y) times K
    for (size_t i = 0; i < pixels; ++i) {
      p[i] = blinn(255 - p[4 * i], p[4 * i + 3]);
    }
    samples.channels = 1;
  }
  return toChannels(samples, channels);
}

}  // namespace data
}  // namespace hddp
