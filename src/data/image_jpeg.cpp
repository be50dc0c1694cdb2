// JPEG through libjpeg-turbo (image_decode.h).
//
// libjpeg's default error handler calls exit(); hddp's error_exit longjmps to readJpeg,
// the only function here that calls setjmp. As in image_png.cpp it is written in C's
// manner: no object with a destructor lives in it or in the callbacks libjpeg calls, so
// the jump skips nothing; all it reports travels in a JpegRead the caller owns, and the
// pixels in a malloc'd buffer that acceptDecoded (image_decode.cpp) frees on every path.
//
// A file that ends early is refused (libjpeg's warning JWRN_JPEG_EOF: its memory source
// then makes up an end of image, and the rest of the image would come out grey; Pillow
// raises "image file is truncated" there). Other warnings (corrupt entropy-coded data,
// which libjpeg fills in; extraneous bytes before a marker, common and harmless) do not
// stop the decoding, as stb_image, which hddp used before, decoded such files too: the
// first is logged, once per file.
//
// Pixels are libjpeg-turbo's defaults (accurate integer IDCT, smooth chroma upsampling),
// equal to Pillow's: they differ from stb_image's by up to 3 levels, and by more in one
// column of a 4:2:2 image, where stb_image 2.27 swaps its chroma weights
// (tests/data/image_decode_test.cpp). Channels are chosen as stb_image chose them: one
// channel of a YCbCr JPEG is its Y plane, one of an RGB JPEG is (77 R + 150 G + 29 B) >> 8,
// CMYK and YCCK become RGB by multiplying each of C, M, Y by K (stbi__blinn_8x8). A mask
// is asked for in its own color space (gray, or RGB for toClassIds to check).
#include <ATen/core/Tensor.h>
#include <jpeglib.h>
// jerror.h after jpeglib.h: the message codes (JWRN_JPEG_EOF).
#include <jerror.h>

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
  DecodeResult result;
  // libjpeg's state lives here too, not in readJpeg: C leaves a local that changed
  // between setjmp and longjmp indeterminate after the jump.
  jpeg_decompress_struct jpeg;
  jpeg_error_mgr errors;
  jpeg_progress_mgr progress;
  jmp_buf jump;
};

static_assert(sizeof(DecodeResult::message) >= JMSG_LENGTH_MAX &&
                  sizeof(DecodeResult::warning) >= JMSG_LENGTH_MAX,
              "libjpeg's format_message writes JMSG_LENGTH_MAX bytes");

void jpegFailed(j_common_ptr common) {
  auto* read = static_cast<JpegRead*>(common->client_data);
  (*common->err->format_message)(common, read->result.message);
  std::longjmp(read->jump, 1);
}

// libjpeg's emit_message: level -1 a warning, 0 and above a trace (ignored).
void jpegWarned(j_common_ptr common, int level) {
  if (level >= 0) {
    return;
  }
  auto* read = static_cast<JpegRead*>(common->client_data);
  DecodeResult* const out = &read->result;
  if (common->err->msg_code == JWRN_JPEG_EOF) {  // the data ends: no use decoding on
    (*common->err->format_message)(common, out->message);
    out->status = DecodeResult::kTruncated;
    std::longjmp(read->jump, 1);
  }
  if (out->warnings++ == 0) {
    (*common->err->format_message)(common, out->warning);
  }
}

void jpegProgress(j_common_ptr common) {
  auto* read = static_cast<JpegRead*>(common->client_data);
  if (reinterpret_cast<j_decompress_ptr>(common)->input_scan_number > kMaxScans) {
    std::snprintf(read->result.message, sizeof(read->result.message),
                  "it has more than %d scans (a real JPEG has about 10)", kMaxScans);
    std::longjmp(read->jump, 1);
  }
}

// The output libjpeg is asked for, from the file's color space.
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

// stbi__blinn_8x8: x * y / 255, rounded.
inline unsigned char blinn(unsigned x, unsigned y) {
  const unsigned t = x * y + 128;
  return static_cast<unsigned char>((t + (t >> 8)) >> 8);
}

// libjpeg's CMYK (C, M, Y, K) to RGB in place: C, M, Y times K; its YCCK (Y, Cb, Cr, K) to
// gray: (255 - Y) times K. Other spaces stay as they are.
void toRgbOrGray(J_COLOR_SPACE outSpace, DecodeResult* out) {
  const size_t pixels = static_cast<size_t>(out->width) * out->height;
  unsigned char* p = out->pixels;
  if (outSpace == JCS_CMYK) {
    for (size_t i = 0; i < pixels; ++i) {
      const unsigned k = p[4 * i + 3];
      p[3 * i] = blinn(p[4 * i], k);
      p[3 * i + 1] = blinn(p[4 * i + 1], k);
      p[3 * i + 2] = blinn(p[4 * i + 2], k);
    }
    out->channels = 3;
  } else if (outSpace == JCS_YCCK) {
    for (size_t i = 0; i < pixels; ++i) {
      p[i] = blinn(255 - p[4 * i], p[4 * i + 3]);
    }
    out->channels = 1;
  }
}

// Returns with read->result.status set; never throws. `read` comes zeroed.
void readJpeg(JpegRead* read) {
  DecodeResult* const out = &read->result;
  out->status = DecodeResult::kFailed;
  jpeg_decompress_struct* jpeg = &read->jpeg;
  jpeg->err = jpeg_std_error(&read->errors);
  read->errors.error_exit = jpegFailed;
  read->errors.emit_message = jpegWarned;
  jpeg->client_data = read;  // kept by jpeg_create_decompress, which may fail already
  if (setjmp(read->jump)) {
    jpeg_destroy_decompress(jpeg);  // safe on a zeroed or partly made object
    return;                         // with out->status kFailed or kTruncated
  }
  jpeg_create_decompress(jpeg);
  read->progress.progress_monitor = jpegProgress;
  jpeg->progress = &read->progress;
  jpeg_mem_src(jpeg, read->data, static_cast<unsigned long>(read->size));
  jpeg_read_header(jpeg, TRUE);
  out->width = jpeg->image_width;
  out->height = jpeg->image_height;
  if (static_cast<int64_t>(out->width) * out->height > read->allowedPixels) {
    out->status = DecodeResult::kTooLarge;
    jpeg_destroy_decompress(jpeg);
    return;
  }
  if (!chooseOutput(jpeg, read)) {
    std::snprintf(out->message, sizeof(out->message),
                  "it has %d components in no color space hddp converts (libjpeg's "
                  "J_COLOR_SPACE %d)",
                  jpeg->num_components, static_cast<int>(jpeg->jpeg_color_space));
    jpeg_destroy_decompress(jpeg);
    return;
  }
  jpeg_start_decompress(jpeg);
  out->channels = jpeg->output_components;
  out->bits = 8;
  const size_t rowBytes = static_cast<size_t>(jpeg->output_width) * jpeg->output_components;
  // At most allowedPixels (< 2^31) x 4 bytes.
  out->pixels = static_cast<unsigned char*>(std::malloc(rowBytes * jpeg->output_height));
  if (out->pixels == nullptr) {
    std::snprintf(out->message, sizeof(out->message), "out of memory for the pixels");
    jpeg_destroy_decompress(jpeg);
    return;
  }
  while (jpeg->output_scanline < jpeg->output_height) {
    JSAMPROW row = out->pixels + jpeg->output_scanline * rowBytes;
    jpeg_read_scanlines(jpeg, &row, 1);
  }
  // Not jpeg_finish_decompress: what follows the last scan changes no pixel.
  const J_COLOR_SPACE outSpace = jpeg->out_color_space;
  jpeg_destroy_decompress(jpeg);
  toRgbOrGray(outSpace, out);
  out->status = DecodeResult::kDecoded;
}

}  // namespace

at::Tensor decodeJpeg(const std::string& bytes, size_t soi, const std::string& path,
                      const DecodeRequest& request) {
  JpegRead read{};
  read.data = reinterpret_cast<const unsigned char*>(bytes.data()) + soi;
  read.size = bytes.size() - soi;
  read.gray = !request.classIds && request.channels == 1;  // a mask: RGB, which toClassIds checks
  read.allowedPixels = allowedPixels(kJpeg, bytes.size(), request.limits);
  readJpeg(&read);
  return acceptDecoded(read.result, path, kJpeg, bytes.size(), request);
}

}  // namespace data
}  // namespace hddp
