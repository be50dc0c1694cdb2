// hddp::decodeImage against references: stb_image 2.27 (hddp's decoder of every format
// before libpng, libjpeg-turbo and its own PGM/PPM reader; compiled here whole) for PNG,
// PGM/PPM, BMP, TGA and GIF, to the bit; Pillow (libjpeg-turbo's defaults, as hddp) for
// JPEG, to the bit, and stb_image within a few levels. PNGs of every color type, bit
// depth and interlacing are written here with libpng; the JPEGs are committed
// (tests/data/images/make_images.py). Built with libpng and libjpeg only
// (tests/CMakeLists.txt): a build that decodes PNG and JPEG with stb_image has no libpng
// to write PNGs with.
#include "data/image_decode.h"

#include <gtest/gtest.h>
#include <png.h>
#include <torch/torch.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "support/image_files.h"
#include "support/ranks.h"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include <stb/stb_image.h>
#include <stb/stb_image_write.h>  // implemented in datasets_test.cpp
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace fs = std::filesystem;

namespace {

using hddp::testing::dataErrorOf;
using hddp::testing::fileContents;
using hddp::testing::sourcePath;
using hddp::testing::writeFile;

// stb_image's decoding of `path` as [channels, H, W] uint8.
at::Tensor stbDecode(const std::string& path, int channels) {
  int w = 0;
  int h = 0;
  int n = 0;
  stbi_uc* pixels = stbi_load(path.c_str(), &w, &h, &n, channels);
  EXPECT_NE(pixels, nullptr) << path << ": " << stbi_failure_reason();
  if (pixels == nullptr) {
    return at::zeros({channels, 1, 1}, at::kByte);
  }
  at::Tensor hwc = at::from_blob(pixels, {h, w, channels}, at::kByte).clone();
  stbi_image_free(pixels);
  return hwc.permute({2, 0, 1}).contiguous();
}

int64_t maxDifference(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kInt) - b.to(at::kInt)).abs().max().item<int64_t>();
}

// A PNG written by libpng: random samples (every palette entry exists, so any index is
// valid), optional tRNS (palette alphas, or a gray / RGB color) and Adam7 interlacing.
struct PngCase {
  const char* name;
  int colorType;
  int bitDepth;
  bool interlaced = false;
  bool trns = false;
};

void writePng(const std::string& path, const PngCase& c, int width, int height, uint32_t seed) {
  FILE* file = std::fopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_init_io(png, file);
  png_set_IHDR(png, info, width, height, c.bitDepth, c.colorType,
               c.interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  std::mt19937 rng(seed);
  std::vector<png_color> palette;
  if (c.colorType == PNG_COLOR_TYPE_PALETTE) {
    for (int i = 0; i < (1 << c.bitDepth); ++i) {
      palette.push_back({static_cast<png_byte>(rng()), static_cast<png_byte>(rng()),
                         static_cast<png_byte>(rng())});
    }
    png_set_PLTE(png, info, palette.data(), static_cast<int>(palette.size()));
  }
  std::vector<png_byte> alphas;
  png_color_16 key{};
  if (c.trns && c.colorType == PNG_COLOR_TYPE_PALETTE) {
    for (size_t i = 0; i < palette.size() / 2 + 1; ++i) {
      alphas.push_back(static_cast<png_byte>(rng()));
    }
    png_set_tRNS(png, info, alphas.data(), static_cast<int>(alphas.size()), nullptr);
  } else if (c.trns) {
    key.gray = key.red = key.green = key.blue = 1;
    png_set_tRNS(png, info, nullptr, 0, &key);
  }
  png_write_info(png, info);
  const size_t rowBytes = png_get_rowbytes(png, info);
  std::vector<png_byte> image(rowBytes * height);
  for (auto& b : image) {
    b = static_cast<png_byte>(rng());
  }
  std::vector<png_bytep> rows;
  for (int y = 0; y < height; ++y) {
    rows.push_back(image.data() + y * rowBytes);
  }
  png_write_image(png, rows.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  std::fclose(file);
}

TEST(ImageDecode, PngOfEveryColorTypeAndBitDepthEqualsStbImage) {
  constexpr int G = PNG_COLOR_TYPE_GRAY, GA = PNG_COLOR_TYPE_GRAY_ALPHA, RGB = PNG_COLOR_TYPE_RGB,
                RGBA = PNG_COLOR_TYPE_RGB_ALPHA, P = PNG_COLOR_TYPE_PALETTE;
  const std::vector<PngCase> cases = {
      {"gray1", G, 1},
      {"gray2", G, 2},
      {"gray4", G, 4},
      {"gray8", G, 8},
      {"gray16", G, 16},
      {"gray8-trns", G, 8, false, true},
      {"gray16-trns", G, 16, false, true},
      {"ga8", GA, 8},
      {"ga16", GA, 16},
      {"rgb8", RGB, 8},
      {"rgb16", RGB, 16},
      {"rgb8-trns", RGB, 8, false, true},
      {"rgba8", RGBA, 8},
      {"rgba16", RGBA, 16},
      {"palette1", P, 1},
      {"palette2", P, 2},
      {"palette4", P, 4},
      {"palette8", P, 8},
      {"palette4-trns", P, 4, false, true},
      {"palette8-trns", P, 8, false, true},
      {"gray1-adam7", G, 1, true},
      {"rgb8-adam7", RGB, 8, true},
      {"rgba16-adam7", RGBA, 16, true},
      {"palette2-adam7-trns", P, 2, true, true},
  };
  const std::string dir = hddp::testing::makeTempDir();
  uint32_t seed = 1;
  for (const PngCase& c : cases) {
    // 13 x 7: rows that end inside a byte below 8 bits, Adam7 passes of unequal sizes;
    // 1 x 1: the passes of an interlaced image that are empty.
    for (const auto& [w, h] : {std::pair{13, 7}, std::pair{1, 1}}) {
      const std::string path = dir + "/" + c.name + "-" + std::to_string(w) + ".png";
      writePng(path, c, w, h, seed++);
      for (const int channels : {1, 3}) {
        const at::Tensor image = hddp::decodeImage(path, channels);
        ASSERT_EQ(image.sizes(), (std::vector<int64_t>{channels, h, w})) << path;
        EXPECT_TRUE(image.equal(stbDecode(path, channels))) << path << " as " << channels;
      }
    }
  }
}

// Binary PGM/PPM: equal to stb_image for 8-bit samples, not scaled by maxval (a mask
// saved with maxval 20 keeps 0..20); 16-bit samples of maxval 65535 keep their high byte
// before channels are converted, as a 16-bit PNG's (stb_image 2.27 kept the low byte: it
// read big-endian samples as little-endian, and converted channels as if they had 8 bits:
// finding 12). Smaller maxvals are scaled: image_mask_test.cpp.
TEST(ImageDecode, PgmAndPpmEqualStbImageAnd16BitSamplesKeepTheirHighByte) {
  const std::string dir = hddp::testing::makeTempDir();
  std::mt19937 rng(7);
  const auto samples = [&rng](size_t n, int maxval) {
    std::string s(n, '\0');
    for (auto& b : s) {
      b = static_cast<char>(rng() % (maxval + 1));
    }
    return s;
  };
  const std::vector<std::pair<std::string, std::string>> files = {
      {"comment.pgm", "P5\n# by hand\n13 7\n255\n" + samples(13 * 7, 255)},
      {"tabs.ppm", "P6\t13\r\n7 # a comment between numbers\n255\r" + samples(13 * 7 * 3, 255)},
      {"mask.pgm", "P5 13 7 20\n" + samples(13 * 7, 20)},
      {"trailing.ppm", "P6 1 1 255 " + samples(3, 255) + "more bytes after the image"},
  };
  for (const auto& [name, bytes] : files) {
    writeFile(dir + "/" + name, bytes);
    for (const int channels : {1, 3}) {
      EXPECT_TRUE(hddp::decodeImage(dir + "/" + name, channels)
                      .equal(stbDecode(dir + "/" + name, channels)))
          << name << " as " << channels;
    }
  }
  EXPECT_EQ(hddp::decodeImage(dir + "/mask.pgm", 1).max().item<int64_t>(), 20);

  // 16 bits: gray 0x1234 and 0xff01; RGB (0x8000, 0x4000, 0x0100) and (0xffff, 0, 0x00ff).
  writeFile(dir + "/16.pgm", std::string("P5 2 1 65535\n\x12\x34\xff\x01", 17));
  writeFile(dir + "/16.ppm",
            std::string("P6 2 1 65535\n\x80\x00\x40\x00\x01\x00\xff\xff\x00\x00\x00\xff", 25));
  const auto to8 = [](int v) { return v >> 8; };  // maxval 65535: the high byte, as PNG's
  EXPECT_TRUE(hddp::decodeImage(dir + "/16.pgm", 1)
                  .equal(torch::tensor({to8(0x1234), to8(0xff01)}, at::kByte).view({1, 1, 2})));
  EXPECT_TRUE(hddp::decodeImage(dir + "/16.pgm", 3)
                  .equal(torch::tensor({to8(0x1234), to8(0xff01)}, at::kByte)
                             .view({1, 1, 2})
                             .expand({3, 1, 2})));
  EXPECT_TRUE(hddp::decodeImage(dir + "/16.ppm", 3)
                  .equal(torch::tensor({to8(0x8000), 255, to8(0x4000), 0, to8(0x0100), to8(0x00ff)},
                                       at::kByte)
                             .view({3, 1, 2})));
  const int y0 = (to8(0x8000) * 77 + to8(0x4000) * 150 + to8(0x0100) * 29) >> 8;
  const int y1 = (255 * 77 + 0 * 150 + to8(0x00ff) * 29) >> 8;
  EXPECT_TRUE(hddp::decodeImage(dir + "/16.ppm", 1)
                  .equal(torch::tensor({y0, y1}, at::kByte).view({1, 1, 2})));
}

// What stb_image still decodes (GIF, BMP, TGA), and Pillow's images of every format
// (the fuzz_image seeds): the same pixels as stb_image, but for JPEG, within 3 levels.
TEST(ImageDecode, BmpTgaGifAndPillowsImagesEqualStbImage) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<uint8_t> rgb(13 * 7 * 3);
  std::mt19937 rng(3);
  for (auto& b : rgb) {
    b = static_cast<uint8_t>(rng() % 4 * 60);  // few colors: TGA's runs
  }
  ASSERT_TRUE(stbi_write_bmp((dir + "/a.bmp").c_str(), 13, 7, 3, rgb.data()));
  ASSERT_TRUE(stbi_write_tga((dir + "/rle.tga").c_str(), 13, 7, 3, rgb.data()));
  stbi_write_tga_with_rle = 0;
  ASSERT_TRUE(stbi_write_tga((dir + "/plain.tga").c_str(), 13, 7, 3, rgb.data()));
  stbi_write_tga_with_rle = 1;
  std::vector<std::string> paths = {dir + "/a.bmp", dir + "/rle.tga", dir + "/plain.tga"};
  for (const auto& entry : fs::directory_iterator(sourcePath("../fuzz/corpus/fuzz_image"))) {
    paths.push_back(entry.path().string());
  }
  ASSERT_GE(paths.size(), 18u);
  for (const std::string& path : paths) {
    const bool jpeg = fs::path(path).extension() == ".jpg";
    for (const int channels : {1, 3}) {
      const at::Tensor image = hddp::decodeImage(path, channels);
      const at::Tensor reference = stbDecode(path, channels);
      ASSERT_EQ(image.sizes(), reference.sizes()) << path;
      if (jpeg) {
        EXPECT_LE(maxDifference(image, reference), 3) << path << " as " << channels;
      } else {
        EXPECT_TRUE(image.equal(reference)) << path << " as " << channels;
      }
    }
  }
}

// JPEG: Pillow's pixels to the bit (RGB, and the Y plane for one channel), stb_image's
// within 3 levels; but one column of a 4:2:2 image: stb_image 2.27 upsamples its chroma's
// last pair of columns with the neighbours' weights swapped (stbi__resample_row_h_2:
// column 2 (ceil(W / 2) - 1) gets 3 parts of the chroma before it and 1 of its own), 70
// and more levels off there, where libjpeg-turbo stays near the source.
TEST(ImageDecode, JpegEqualsPillowAndStaysWithinThreeLevelsOfStbImage) {
  for (const char* stem : {"rgb-444", "rgb-422", "rgb-420", "progressive", "gray", "odd-422"}) {
    const std::string base = sourcePath("data/images/") + stem;
    const at::Tensor rgb = hddp::decodeImage(base + ".jpg", 3);
    const at::Tensor y = hddp::decodeImage(base + ".jpg", 1);
    const std::string rgbBytes = fileContents(base + ".rgb");
    const std::string yBytes = fileContents(base + ".y");
    const int64_t h = rgb.size(1);
    const int64_t w = rgb.size(2);
    ASSERT_EQ(static_cast<int64_t>(rgbBytes.size()), h * w * 3) << stem;
    ASSERT_EQ(static_cast<int64_t>(yBytes.size()), h * w) << stem;
    const at::Tensor pillowRgb =
        torch::from_blob(const_cast<char*>(rgbBytes.data()), {h, w, 3}, at::kByte)
            .permute({2, 0, 1});
    const at::Tensor pillowY =
        torch::from_blob(const_cast<char*>(yBytes.data()), {1, h, w}, at::kByte);
    EXPECT_TRUE(rgb.equal(pillowRgb)) << stem << ": " << maxDifference(rgb, pillowRgb);
    EXPECT_TRUE(y.equal(pillowY)) << stem << ": " << maxDifference(y, pillowY);
    for (const int channels : {1, 3}) {
      at::Tensor mine = (channels == 3 ? rgb : y).clone();
      at::Tensor stb = stbDecode(base + ".jpg", channels);
      if (std::string(stem).find("422") != std::string::npos) {
        const int64_t swapped = 2 * ((w + 1) / 2 - 1);
        mine.select(2, swapped).zero_();
        stb.select(2, swapped).zero_();
      }
      EXPECT_LE(maxDifference(mine, stb), 3) << stem << " as " << channels;
    }
  }
}

// A CMYK JPEG (Adobe, inverted, as Photoshop and Pillow write it): RGB as stb_image
// makes it (C, M, Y times K), within a level.
TEST(ImageDecode, CmykJpegBecomesRgbAsStbImageMakesIt) {
  const std::string path = sourcePath("data/images/cmyk.jpg");
  for (const int channels : {1, 3}) {
    EXPECT_LE(maxDifference(hddp::decodeImage(path, channels), stbDecode(path, channels)), 1)
        << channels;
  }
}

}  // namespace

namespace {

// The CRC of a PNG chunk (type and data), written after it.
void fixPngCrc(std::string& png, size_t chunkStart) {
  const auto* p = reinterpret_cast<const unsigned char*>(png.data());
  const uint32_t length = (p[chunkStart] << 24) | (p[chunkStart + 1] << 16) |
                          (p[chunkStart + 2] << 8) | p[chunkStart + 3];
  const uLong crc = crc32(0, p + chunkStart + 4, 4 + length);
  for (int i = 0; i < 4; ++i) {
    png[chunkStart + 8 + length + i] = static_cast<char>((crc >> (24 - 8 * i)) & 0xff);
  }
}

// An IDAT chunk may be empty (PNG 1.2, 11.2.4); Debian's stb_image 2.27 copied 0 bytes from
// a null pointer for an empty first one (the fuzzers' png-empty-first-idat-...png).
TEST(ImageDecode, PngWithAnEmptyFirstIdatDecodes) {
  const std::string dir = hddp::testing::makeTempDir();
  writePng(dir + "/a.png", {"rgba8", PNG_COLOR_TYPE_RGB_ALPHA, 8}, 13, 7, 11);
  std::string png = fileContents(dir + "/a.png");
  const size_t idat = png.find("IDAT") - 4;
  png.insert(idat, std::string("\0\0\0\0IDAT\0\0\0\0", 12));
  fixPngCrc(png, idat);
  writeFile(dir + "/empty-idat.png", png);
  for (const int channels : {1, 3}) {
    EXPECT_TRUE(hddp::decodeImage(dir + "/empty-idat.png", channels)
                    .equal(hddp::decodeImage(dir + "/a.png", channels)));
  }
}

// Sizes are checked before anything is allocated for the pixels, with each decoder:
// against ImageLimits, and against what the file's bytes can describe in its format.
TEST(ImageDecode, EachDecoderChecksTheClaimedSizeBeforeAllocating) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string jpeg = sourcePath("data/images/rgb-420.jpg");  // 26 x 17 = 442 pixels
  EXPECT_EQ(hddp::decodeImage(jpeg, 3, hddp::ImageLimits{442}).size(2), 26);
  EXPECT_NE(dataErrorOf([&] {
              hddp::decodeImage(jpeg, 3, hddp::ImageLimits{441});
            }).find("26x17 (442 pixels), more than the limit of 441"),
            std::string::npos);
  writeFile(dir + "/a.pgm", "P5 26 17 255\n" + std::string(442, '\x7f'));
  EXPECT_EQ(hddp::decodeImage(dir + "/a.pgm", 1, hddp::ImageLimits{442}).size(1), 17);
  EXPECT_NE(dataErrorOf([&] {
              hddp::decodeImage(dir + "/a.pgm", 1, hddp::ImageLimits{441});
            }).find("more than the limit of 441"),
            std::string::npos);

  // The JPEG's frame header (SOF) says 60000 x 60000.
  std::string big = fileContents(jpeg);
  const size_t sof = big.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  big.replace(sof + 5, 4, "\xea\x60\xea\x60");
  writeFile(dir + "/big.jpg", big);
  EXPECT_NE(dataErrorOf([&] { hddp::decodeImage(dir + "/big.jpg", 3); })
                .find("60000x60000 pixels, more than its " + std::to_string(big.size()) +
                      " bytes can describe as JPEG"),
            std::string::npos);
  // The PNG's IHDR says 65536 x 65536, with its CRC right.
  writePng(dir + "/small.png", {"rgb8", PNG_COLOR_TYPE_RGB, 8}, 13, 7, 5);
  std::string png = fileContents(dir + "/small.png");
  png.replace(16, 8, std::string("\x00\x01\x00\x00\x00\x01\x00\x00", 8));
  fixPngCrc(png, 8);
  writeFile(dir + "/big.png", png);
  EXPECT_NE(dataErrorOf([&] { hddp::decodeImage(dir + "/big.png", 3); })
                .find("65536x65536 pixels, more than its " + std::to_string(png.size()) +
                      " bytes can describe as PNG"),
            std::string::npos);
  writeFile(dir + "/big.pgm", "P5 1000 1000 255\n" + std::string(100, '\0'));
  EXPECT_NE(dataErrorOf([&] {
              hddp::decodeImage(dir + "/big.pgm", 3);
            }).find("1000x1000 pixels, more than its 117 bytes can describe as PGM/PPM"),
            std::string::npos);
}

// Damaged files: a DataError that names the file and says what is wrong (libpng's and
// libjpeg's own words for theirs), never a crash, an exit or another exception.
TEST(ImageDecode, DamagedFilesAreRefusedWithWhatIsWrong) {
  const std::string dir = hddp::testing::makeTempDir();
  writePng(dir + "/good.png", {"rgb8", PNG_COLOR_TYPE_RGB, 8}, 13, 7, 9);
  const std::string png = fileContents(dir + "/good.png");
  std::string badCrc = png;
  badCrc[20] ^= 1;  // inside IHDR's data
  const std::string jpeg = fileContents(sourcePath("data/images/rgb-444.jpg"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"truncated.png", png.substr(0, png.size() / 2)},
      {"crc.png", badCrc},
      {"header-only.jpg", jpeg.substr(0, 20)},
      {"overflow.pgm", "P5 99999999999 1 255\n"},
      {"no-space.pgm", "P5 2 2 255x1234"},
      {"maxval.pgm", "P5 2 2 65536\n1234"},
      {"zero.pgm", "P5 0 2 255\n"},
      {"truncated.pgm", "P5 2 2 255\n\x01"},
      {"ascii.pgm", "P2 2 2 255\n1 2 3 4\n"},
      {"empty.png", ""},
  };
  const std::vector<std::string> expected = {
      "(PNG): the file ends inside the PNG (truncated)",
      "(PNG): IHDR: CRC error",
      "(JPEG): ",
      "the PGM/PPM header's width at byte 3 is larger than 2147483647",
      "maxval is not followed by a whitespace byte (byte 10)",
      "the PGM/PPM header's maxval at byte 7 is larger than 65535",
      "says 0x2 pixels with maxval 255; each must be at least 1",
      "take 4 bytes after its header, the file has 1: it is truncated",
      "a Netpbm file of type P2; hddp reads binary PGM (P5) and PPM (P6) only",
      "(hddp reads PNG, JPEG, GIF, BMP, TGA and binary PGM/PPM)",
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = dir + "/" + cases[i].first;
    writeFile(path, cases[i].second);
    for (const int channels : {1, 3}) {
      const std::string error = dataErrorOf([&] { hddp::decodeImage(path, channels); });
      EXPECT_NE(error.find(path), std::string::npos) << error;
      EXPECT_NE(error.find(expected[i]), std::string::npos) << error;
    }
  }
}

}  // namespace
