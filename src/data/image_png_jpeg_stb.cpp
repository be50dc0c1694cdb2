// PNG and JPEG through stb_image, for a build without libpng or libjpeg: a GPU machine
// with no package access, configured with HDDP_DEVICE_DEPS (cmake/HddpDependencies.cmake
// compiles this file instead of image_png.cpp and image_jpeg.cpp, with a warning).
//
// Debian's stb_image 2.27 has open faults on crafted files that the fuzzers found (docs/
// development.md, "Fuzzing"): this file is not fuzzed and not meant for files from
// outside. What hddp checked before decoding while stb_image read every format stays:
// the size a header claims, and the JPEG Huffman tables stb_image 2.27 writes past.
//
// stb_image itself is in image_stb.cpp (decodeWithStb), compiled here with
// HDDP_STB_PNG_JPEG. It expands a palette to RGB and gives no way to keep a palette
// PNG's indices: in this build a palette mask must have a gray palette, or it is refused
// (toClassIds); a 16-bit gray mask keeps its values.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <string>

#include "data/image_decode.h"
#include "hddp/core/error.h"

namespace hddp {
namespace data {

namespace {

// stb_image 2.27 builds a JPEG Huffman table from the 16 counts of a DHT segment without
// checking that they count 256 codes at most (nothings/stb#1291, fixed in 2.28). Every
// DHT segment is read first, wherever it stands, as stb_image reads it: bytes past the
// end of the file count as zeros.
void checkJpegHuffmanTables(const std::string& b, size_t soi, const std::string& path) {
  const auto at = [&b](size_t i) -> size_t {
    return i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
  };
  for (size_t pos = soi + 2; pos + 1 < b.size();) {
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

}  // namespace

at::Tensor decodePng(const std::string& bytes, const std::string& path,
                     const DecodeRequest& request) {
  return decodeWithStb(bytes, path, kPng, request);
}

at::Tensor decodeJpeg(const std::string& bytes, size_t soi, const std::string& path,
                      const DecodeRequest& request) {
  checkJpegHuffmanTables(bytes, soi, path);
  return decodeWithStb(bytes, path, kJpeg, request);
}

std::string pngJpegDecoders() { return "stb_image (fallback)"; }

}  // namespace data
}  // namespace hddp
