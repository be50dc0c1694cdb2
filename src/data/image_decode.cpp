// hddp::decodeImage: reads the file, tells its format by its first bytes and hands it to
// that format's decoder (image_decode.h); the checks and the conversions they share.
#include "data/image_decode.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_set>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace data {

int64_t allowedPixels(const ImageFormat& format, size_t fileBytes, const ImageLimits& limits) {
  // fileBytes <= 2^31 (decodeImage checks) and pixelsPerByte < 2^14: no overflow.
  return std::min(limits.maxPixels, format.pixelsPerByte * static_cast<int64_t>(fileBytes));
}

void checkImagePixels(const std::string& path, const ImageFormat& format, int64_t width,
                      int64_t height, size_t fileBytes, const ImageLimits& limits) {
  // Each is at most 2^31 (the decoders' header fields): the product fits.
  HDDP_INTERNAL_ASSERT(width >= 0 && height >= 0 && width <= (int64_t{1} << 31) &&
                       height <= (int64_t{1} << 31));
  const int64_t pixels = width * height;
  const int64_t describable = format.pixelsPerByte * static_cast<int64_t>(fileBytes);
  HDDP_CHECK_AS(DataError, pixels <= describable, "cannot decode image ", path, ": it claims ",
                width, "x", height, " pixels, more than its ", fileBytes, " bytes can describe as ",
                format.name, " (", format.pixelsPerByte,
                " pixels a byte at most): the file is damaged or crafted");
  HDDP_CHECK_AS(DataError, pixels <= limits.maxPixels, "image ", path, " is ", width, "x", height,
                " (", pixels, " pixels), more than the limit of ", limits.maxPixels,
                " pixels (ImageLimits::maxPixels)");
}

namespace {

// stb_image's stbi__compute_y and stbi__compute_y_16: the same weights in 8 and 16 bits.
inline int luma(int r, int g, int b) { return (r * 77 + g * 150 + b * 29) >> 8; }

template <int Bits>
void convert(const Samples& s, int channels, uint8_t* out) {
  const int64_t plane = s.width * s.height;
  const int n = s.channels;
  const uint8_t* in = s.data;
  const auto sample = [in](int64_t i) -> int {
    if constexpr (Bits == 8) {
      return in[i];
    } else {
      return (in[2 * i] << 8) | in[2 * i + 1];
    }
  };
  constexpr int kShift = Bits - 8;  // 16 -> 8 bits keeps the high byte, as stb_image does
  for (int64_t p = 0; p < plane; ++p) {
    const int64_t i = p * n;
    if (channels == 1) {
      const int y = n >= 3 ? luma(sample(i), sample(i + 1), sample(i + 2)) : sample(i);
      out[p] = static_cast<uint8_t>(y >> kShift);
    } else if (n >= 3) {
      out[p] = static_cast<uint8_t>(sample(i) >> kShift);
      out[plane + p] = static_cast<uint8_t>(sample(i + 1) >> kShift);
      out[2 * plane + p] = static_cast<uint8_t>(sample(i + 2) >> kShift);
    } else {
      const auto gray = static_cast<uint8_t>(sample(i) >> kShift);
      out[p] = out[plane + p] = out[2 * plane + p] = gray;
    }
  }
}

// Where a JPEG's SOI marker begins, or npos for no JPEG: stb_image took fill bytes
// (0xFF) before it too.
size_t jpegStart(const std::string& b) {
  size_t i = 0;
  while (i < b.size() && static_cast<unsigned char>(b[i]) == 0xFF) {
    ++i;
  }
  return i > 0 && i < b.size() && static_cast<unsigned char>(b[i]) == 0xD8 ? i - 1
                                                                           : std::string::npos;
}

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

// Whether `path` has not had its decoder's warnings logged yet in this process (a file
// is decoded every epoch, and its mask once more when its dataset is made).
bool firstWarningOf(const std::string& path) {
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  std::lock_guard<std::mutex> lock(mutex);
  return warned.insert(path).second;
}

std::string readImageFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  HDDP_CHECK_AS(DataError, in.good(), "cannot open image ", path);
  const std::streamoff size = in.tellg();
  HDDP_CHECK_AS(DataError, size >= 0, "cannot read image ", path);
  // 2 GiB: more than any image within the default ImageLimits takes, and what
  // stb_image's int offsets and libjpeg's long sizes hold everywhere.
  HDDP_CHECK_AS(DataError, size <= std::numeric_limits<int>::max(), "image ", path, " has ", size,
                " bytes, more than hddp reads as an image (2 GiB)");
  std::string bytes(static_cast<size_t>(size), '\0');
  in.seekg(0);
  in.read(bytes.data(), size);
  HDDP_CHECK_AS(DataError, in.gcount() == size, "cannot read image ", path, ": it has ", size,
                " bytes, ", in.gcount(), " could be read");
  return bytes;
}

}  // namespace

at::Tensor toChannels(const Samples& samples, int channels) {
  HDDP_INTERNAL_ASSERT(samples.channels >= 1 && samples.channels <= 4);
  HDDP_INTERNAL_ASSERT(samples.bits == 8 || samples.bits == 16);
  HDDP_INTERNAL_ASSERT(channels == 1 || channels == 3);
  at::Tensor out = at::empty({channels, samples.height, samples.width}, at::kByte);
  if (samples.bits == 8) {
    convert<8>(samples, channels, out.data_ptr<uint8_t>());
  } else {
    convert<16>(samples, channels, out.data_ptr<uint8_t>());
  }
  return out;
}

at::Tensor toClassIds(const Samples& s, const std::string& path) {
  HDDP_INTERNAL_ASSERT(s.channels >= 1 && s.channels <= 4);
  HDDP_INTERNAL_ASSERT(s.bits == 8 || s.bits == 16);
  at::Tensor out = at::empty({1, s.height, s.width}, at::kByte);
  uint8_t* ids = out.data_ptr<uint8_t>();
  const int64_t plane = s.width * s.height;
  const int n = s.channels;
  const int bytes = s.bits / 8;
  const auto sample = [&s, bytes](int64_t i) -> int {
    return bytes == 1 ? s.data[i] : (s.data[2 * i] << 8) | s.data[2 * i + 1];
  };
  for (int64_t p = 0; p < plane; ++p) {
    const int64_t i = p * n;
    const int id = sample(i);
    HDDP_CHECK_AS(DataError, n < 3 || (sample(i + 1) == id && sample(i + 2) == id), "cannot read ",
                  path, " as a mask: its pixel (x ", p % s.width, ", y ", p / s.width,
                  ") has the colors (", id, ", ", sample(i + 1), ", ", sample(i + 2),
                  "), but a mask must hold class ids in one channel: save it as a palette "
                  "PNG (the indices are the ids) or a gray one (the values are), e.g. with "
                  "Pillow's Image.fromarray(ids.astype('uint8')).save('mask.png')");
    HDDP_CHECK_AS(DataError, id <= 255, "cannot read ", path, " as a mask: its pixel (x ",
                  p % s.width, ", y ", p / s.width, ") holds ", id,
                  "; hddp reads class ids 0..255 (a 16-bit mask whose values fit is read as it "
                  "is): save the mask with 8 bits");
    ids[p] = static_cast<uint8_t>(id);
  }
  return out;
}

at::Tensor toRequested(const Samples& samples, const DecodeRequest& request,
                       const std::string& path) {
  return request.classIds ? toClassIds(samples, path) : toChannels(samples, request.channels);
}

at::Tensor acceptDecoded(DecodeResult& result, const std::string& path, const ImageFormat& format,
                         size_t fileBytes, const DecodeRequest& request) {
  const std::unique_ptr<unsigned char, decltype(&std::free)> owner(result.pixels, &std::free);
  result.pixels = nullptr;
  if (result.status == DecodeResult::kTooLarge) {
    checkImagePixels(path, format, result.width, result.height, fileBytes, request.limits);
  }
  HDDP_CHECK_AS(DataError, result.status != DecodeResult::kTruncated, "cannot decode image ", path,
                " (", format.name, "): the file is truncated (", result.message,
                "): its end is missing, and the rest of the image would be made up; re-encode "
                "it from the original or remove it from the dataset");
  HDDP_CHECK_AS(DataError, result.status == DecodeResult::kDecoded, "cannot decode image ", path,
                " (", format.name, "): ", result.message);
  if (result.warnings > 0 && firstWarningOf(path)) {
    HDDP_LOG_WARN("data", "image ", path, " (", format.name, "): decoded despite ", result.warnings,
                  " warning(s) of the decoder, the first: ", result.warning,
                  " (said once per file)");
  }
  Samples samples;
  samples.data = owner.get();
  samples.width = result.width;
  samples.height = result.height;
  samples.channels = result.channels;
  samples.bits = result.bits;
  return toRequested(samples, request, path);
}

at::Tensor decodeFile(const std::string& path, const DecodeRequest& request) {
  HDDP_INTERNAL_ASSERT(request.classIds || request.channels == 1 || request.channels == 3);
  const std::string bytes = readImageFile(path);
  const auto starts = [&bytes](const char* magic, size_t n) {
    return bytes.size() >= n && bytes.compare(0, n, magic, n) == 0;
  };
  if (starts("\x89PNG\r\n\x1a\n", 8)) {
    return decodePng(bytes, path, request);
  }
  if (const size_t soi = jpegStart(bytes); soi != std::string::npos) {
    return decodeJpeg(bytes, soi, path, request);
  }
  if (bytes.size() >= 2 && bytes[0] == 'P' && bytes[1] >= '1' && bytes[1] <= '7') {
    return decodePnm(bytes, path, request);  // no TGA starts so
  }
  return decodeWithStb(bytes, path, stbFormat(bytes), request);
}

}  // namespace data

at::Tensor decodeImage(const std::string& path, int channels, const ImageLimits& limits) {
  HDDP_CHECK_AS(DataError, channels == 1 || channels == 3,
                "decodeImage: channels must be 1 or 3, got ", channels);
  data::DecodeRequest request;
  request.channels = channels;
  request.limits = limits;
  return data::decodeFile(path, request);
}

}  // namespace hddp
