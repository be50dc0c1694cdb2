// Binary PGM (P5) and PPM (P6), read by hddp itself (image_decode.h).
//
// The header is "P5" or "P6", then width, height and maxval as decimal numbers, separated
// by whitespace and '#' comments (to the end of the line), then one whitespace byte and
// the samples: a byte each for maxval < 256, two (big-endian) otherwise.
//
// Samples of one byte are taken as they are, not scaled by maxval (stb_image, which hddp
// used before, did not scale either; a mask saved with maxval 20 keeps its class ids
// 0..20). Samples of two bytes (maxval 256..65535) are scaled to 8 bits in an image,
// (v * 255 + maxval / 2) / maxval, so that maxval 1000's 1000 is 255; at maxval 65535
// they keep their high byte, as a 16-bit PNG's do (one picture decodes alike from either
// file). In a mask they are class ids as they are, refused above 255 (toClassIds). Numbers are
// checked for overflow and the samples against the bytes present before anything is allocated.
// ASCII PGM/PPM (P2, P3), PBM (P1, P4) and PAM (P7) are refused with a message.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "data/image_decode.h"
#include "hddp/core/error.h"

namespace hddp {
namespace data {

namespace {

constexpr int64_t kMaxHeaderNumber = 2147483647;  // 2^31 - 1: a width or a height

bool isPnmSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

class PnmHeader {
 public:
  PnmHeader(const std::string& bytes, const std::string& path) : b_(bytes), path_(path) {}

  // Whitespace and comments before a number: at least one whitespace byte or comment.
  void separator(const char* before) {
    const size_t start = pos_;
    for (;;) {
      while (pos_ < b_.size() && isPnmSpace(b_[pos_])) {
        ++pos_;
      }
      if (pos_ >= b_.size() || b_[pos_] != '#') {
        break;
      }
      while (pos_ < b_.size() && b_[pos_] != '\n' && b_[pos_] != '\r') {
        ++pos_;
      }
    }
    HDDP_CHECK_AS(DataError, pos_ > start, "cannot decode image ", path_,
                  ": its PGM/PPM header has no whitespace before its ", before, " (byte ", start,
                  ")");
  }

  int64_t number(const char* what, int64_t max) {
    const size_t start = pos_;
    int64_t value = 0;
    while (pos_ < b_.size() && b_[pos_] >= '0' && b_[pos_] <= '9') {
      value = value * 10 + (b_[pos_] - '0');
      HDDP_CHECK_AS(DataError, value <= max, "cannot decode image ", path_,
                    ": the PGM/PPM header's ", what, " at byte ", start, " is larger than ", max,
                    ": the file is damaged or crafted");
      ++pos_;
    }
    HDDP_CHECK_AS(DataError, pos_ > start, "cannot decode image ", path_,
                  ": the PGM/PPM header has no ", what, " at byte ", start,
                  pos_ < b_.size() ? "" : " (the file ends there)");
    return value;
  }

  // The one whitespace byte between maxval and the samples.
  size_t samplesStart() {
    HDDP_CHECK_AS(
        DataError, pos_ < b_.size() && isPnmSpace(b_[pos_]), "cannot decode image ", path_,
        ": its PGM/PPM header's maxval is not followed by a whitespace byte (byte ", pos_, ")");
    return pos_ + 1;
  }

  void skip(size_t n) { pos_ += n; }

 private:
  const std::string& b_;
  const std::string& path_;
  size_t pos_ = 0;
};

// 16-bit big-endian samples of at most `maxval` (above it: 255) to 8 bits: the high byte
// at maxval 65535, as a 16-bit PNG's (toChannels), so that one picture decodes alike from
// either; rounded v * 255 / maxval below it.
std::vector<uint8_t> scaleTo8Bits(const uint8_t* samples, int64_t count, int64_t maxval) {
  std::vector<uint8_t> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t v = (samples[2 * i] << 8) | samples[2 * i + 1];
    out[i] = maxval == 65535
                 ? samples[2 * i]
                 : static_cast<uint8_t>(std::min<int64_t>(255, (v * 255 + maxval / 2) / maxval));
  }
  return out;
}

}  // namespace

at::Tensor decodePnm(const std::string& bytes, const std::string& path,
                     const DecodeRequest& request) {
  const char kind = bytes.size() >= 2 ? bytes[1] : '?';
  HDDP_CHECK_AS(DataError, kind == '5' || kind == '6', "cannot decode image ", path,
                ": it is a Netpbm file of type P", kind,
                "; hddp reads binary PGM (P5) and PPM (P6) only: convert it, e.g. with "
                "Pillow's Image.open(...).save(\"x.pgm\") or pnmtopnm");
  PnmHeader header(bytes, path);
  header.skip(2);
  header.separator("width");
  const int64_t width = header.number("width", kMaxHeaderNumber);
  header.separator("height");
  const int64_t height = header.number("height", kMaxHeaderNumber);
  header.separator("maxval");
  const int64_t maxval = header.number("maxval", 65535);
  const size_t start = header.samplesStart();
  HDDP_CHECK_AS(DataError, width > 0 && height > 0 && maxval > 0, "cannot decode image ", path,
                ": its PGM/PPM header says ", width, "x", height, " pixels with maxval ", maxval,
                "; each must be at least 1");
  checkImagePixels(path, kPnm, width, height, bytes.size(), request.limits);
  const int n = kind == '6' ? 3 : 1;
  const int bits = maxval > 255 ? 16 : 8;
  // width x height <= the file's size (kPnm): no overflow.
  const int64_t needed = width * height * n * (bits / 8);
  const int64_t present = static_cast<int64_t>(bytes.size() - start);
  HDDP_CHECK_AS(DataError, needed <= present, "cannot decode image ", path, ": its ", width, "x",
                height, " ", n == 3 ? "RGB" : "gray", " pixels of ", bits, " bits take ", needed,
                " bytes after its header, the file has ", present, ": it is truncated");
  Samples samples;
  samples.data = reinterpret_cast<const uint8_t*>(bytes.data()) + start;
  samples.width = width;
  samples.height = height;
  samples.channels = n;
  samples.bits = bits;
  if (bits == 16 && !request.classIds) {
    const std::vector<uint8_t> scaled = scaleTo8Bits(samples.data, width * height * n, maxval);
    samples.data = scaled.data();
    samples.bits = 8;
    return toChannels(samples, request.channels);
  }
  return toRequested(samples, request, path);
}

}  // namespace data
}  // namespace hddp
