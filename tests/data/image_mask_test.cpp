// Masks read as class ids (data::decodeMask: a palette PNG's indices, 16-bit gray values,
// gray stored as RGB; colored masks refused), PGM/PPM of 16 bits scaled to 8 in images,
// and truncated or warned-about JPEGs. Built with libpng and libjpeg only
// (tests/CMakeLists.txt), as image_decode_test.cpp: it writes PNGs with libpng.
#include <gtest/gtest.h>
#include <png.h>
#include <stb/stb_image_write.h>  // declarations; implemented in datasets_test.cpp
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "data/image_decode.h"
#include "data/image_io.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"
#include "support/image_files.h"
#include "support/ranks.h"

namespace {

using hddp::testing::dataErrorOf;
using hddp::testing::fileContents;
using hddp::testing::sourcePath;
using hddp::testing::writeFile;

// A PNG of `values` (row after row, `channels` a pixel), written by libpng: a palette
// (`palette`, 3 bytes an entry) of 1..8 bits, or gray / RGB of 8 or 16 bits.
void writePng(const std::string& path, int colorType, int bitDepth, int width, int height,
              const std::vector<int>& values, const std::vector<png_color>& palette = {}) {
  FILE* file = std::fopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_init_io(png, file);
  png_set_IHDR(png, info, width, height, bitDepth, colorType, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  if (!palette.empty()) {
    png_set_PLTE(png, info, palette.data(), static_cast<int>(palette.size()));
  }
  png_write_info(png, info);
  if (bitDepth < 8) {
    png_set_packing(png);  // a byte a pixel in, packed in the file
  }
  const int bytes = bitDepth == 16 ? 2 : 1;
  const size_t perRow = values.size() / height;
  std::vector<png_byte> row(perRow * bytes);
  for (int y = 0; y < height; ++y) {
    for (size_t i = 0; i < perRow; ++i) {
      const int v = values[y * perRow + i];
      if (bytes == 2) {
        row[2 * i] = static_cast<png_byte>(v >> 8);  // PNG's big-endian
        row[2 * i + 1] = static_cast<png_byte>(v & 0xff);
      } else {
        row[i] = static_cast<png_byte>(v);
      }
    }
    png_write_row(png, row.data());
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  std::fclose(file);
}

// PASCAL VOC's palette: class 1 is (128, 0, 0), 255 (the boundary) (224, 224, 192).
std::vector<png_color> vocPalette() {
  std::vector<png_color> palette(256);
  for (int i = 0; i < 256; ++i) {
    int r = 0, g = 0, b = 0;
    for (int bit = 0, c = i; bit < 8; ++bit, c >>= 3) {
      r |= ((c >> 0) & 1) << (7 - bit);
      g |= ((c >> 1) & 1) << (7 - bit);
      b |= ((c >> 2) & 1) << (7 - bit);
    }
    palette[i] = {static_cast<png_byte>(r), static_cast<png_byte>(g), static_cast<png_byte>(b)};
  }
  return palette;
}

at::Tensor ids(const std::vector<int>& values, int64_t height, int64_t width) {
  return torch::tensor(std::vector<int64_t>(values.begin(), values.end())).view({height, width});
}

// A VOC mask's class 1 used to come out as 38 and 255 as 220 (the palette's colors, then
// their luma): the indices are the class ids, at every palette bit depth.
TEST(ImageMask, PaletteMasksKeepTheirIndices) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::vector<int> voc = {0, 1, 2, 15, 20, 255, 1, 0};
  writePng(dir + "/voc.png", PNG_COLOR_TYPE_PALETTE, 8, 4, 2, voc, vocPalette());
  EXPECT_TRUE(hddp::data::decodeMask(dir + "/voc.png", false).equal(ids(voc, 2, 4)));
  ASSERT_EQ(vocPalette()[1].red, 128);
  EXPECT_EQ(hddp::decodeImage(dir + "/voc.png", 3)[0][0][1].item<int>(), 128);  // images: RGB
  for (const int bits : {1, 2, 4}) {
    std::vector<int> values;
    for (int i = 0; i < 13 * 3; ++i) {
      values.push_back(i * 7 % (1 << bits));
    }
    const std::string path = dir + "/p" + std::to_string(bits) + ".png";
    std::vector<png_color> palette = vocPalette();
    palette.resize(1 << bits);
    writePng(path, PNG_COLOR_TYPE_PALETTE, bits, 13, 3, values, palette);
    EXPECT_TRUE(hddp::data::decodeMask(path, false).equal(ids(values, 3, 13))) << bits;
  }
}

// 16-bit gray: the values, not their high byte (0..20 all became 0); above 255 refused.
TEST(ImageMask, SixteenBitGrayMasksKeepTheirValuesUpTo255) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::vector<int> values = {0, 1, 7, 20, 255, 3};
  writePng(dir + "/16.png", PNG_COLOR_TYPE_GRAY, 16, 3, 2, values);
  EXPECT_TRUE(hddp::data::decodeMask(dir + "/16.png", false).equal(ids(values, 2, 3)));
  writePng(dir + "/big.png", PNG_COLOR_TYPE_GRAY, 16, 3, 1, {0, 1000, 2});
  const std::string error = dataErrorOf([&] { hddp::data::decodeMask(dir + "/big.png", false); });
  EXPECT_NE(error.find(dir + "/big.png as a mask: its pixel (x 1, y 0) holds 1000"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("class ids 0..255"), std::string::npos) << error;
}

// Gray of 1, 2 and 4 bits: a mask's ids as stored (a 2-bit mask's 3 was 255, and the
// dataset then counted 256 classes); an image's gray scaled to 0..255 as before.
TEST(ImageMask, LowBitGrayMasksKeepTheirValues) {
  const std::string dir = hddp::testing::makeTempDir();
  for (const int bits : {1, 2, 4}) {
    std::vector<int> values;
    for (int i = 0; i < 11 * 2; ++i) {
      values.push_back(i * 5 % (1 << bits));
    }
    const std::string path = dir + "/g" + std::to_string(bits) + ".png";
    writePng(path, PNG_COLOR_TYPE_GRAY, bits, 11, 2, values);
    EXPECT_TRUE(hddp::data::decodeMask(path, false).equal(ids(values, 2, 11))) << bits;
    EXPECT_EQ(hddp::decodeImage(path, 1).max().item<int>(), 255) << bits;  // the top value
  }
}

// One 16-bit picture, as a PNG and as a PGM of maxval 65535, decodes to the same pixels.
TEST(ImageMask, SixteenBitPngAndPgmDecodeAlike) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::vector<int> values = {0, 1, 0x1234, 0x7fff, 0x8080, 0xff01, 0xff80, 0xffff};
  writePng(dir + "/16.png", PNG_COLOR_TYPE_GRAY, 16, 4, 2, values);
  std::string pgm = "P5 4 2 65535\n";
  for (const int v : values) {
    pgm += static_cast<char>(v >> 8);
    pgm += static_cast<char>(v & 0xff);
  }
  writeFile(dir + "/16.pgm", pgm);
  const at::Tensor png = hddp::decodeImage(dir + "/16.png", 1);
  EXPECT_TRUE(png.equal(hddp::decodeImage(dir + "/16.pgm", 1)))
      << png << hddp::decodeImage(dir + "/16.pgm", 1);
}

// Gray stored as RGB (PNG, and BMP and TGA through stb_image) is that gray; colors that
// differ are no class ids and are refused, naming the pixel.
TEST(ImageMask, RgbMasksOfEqualColorsAreGrayAndOthersAreRefused) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::vector<int> gray = {0, 0, 0, 3, 3, 3, 9, 9, 9, 255, 255, 255};
  const std::vector<int> expected = {0, 3, 9, 255};
  writePng(dir + "/gray.png", PNG_COLOR_TYPE_RGB, 8, 2, 2, gray);
  EXPECT_TRUE(hddp::data::decodeMask(dir + "/gray.png", false).equal(ids(expected, 2, 2)));
  std::vector<uint8_t> bytes(gray.begin(), gray.end());
  ASSERT_TRUE(stbi_write_bmp((dir + "/gray.bmp").c_str(), 2, 2, 3, bytes.data()));
  ASSERT_TRUE(stbi_write_tga((dir + "/gray.tga").c_str(), 2, 2, 3, bytes.data()));
  for (const char* name : {"/gray.bmp", "/gray.tga"}) {
    EXPECT_TRUE(hddp::data::decodeMask(dir + name, false).equal(ids(expected, 2, 2))) << name;
  }

  std::vector<int> colored = gray;
  colored[10] = 128;  // pixel (1, 1): (255, 128, 255)
  writePng(dir + "/colored.png", PNG_COLOR_TYPE_RGB, 8, 2, 2, colored);
  bytes.assign(colored.begin(), colored.end());
  ASSERT_TRUE(stbi_write_bmp((dir + "/colored.bmp").c_str(), 2, 2, 3, bytes.data()));
  for (const char* name : {"/colored.png", "/colored.bmp"}) {
    const std::string error = dataErrorOf([&] { hddp::data::decodeMask(dir + name, false); });
    EXPECT_NE(error.find(dir + name +
                         " as a mask: its pixel (x 1, y 1) has the colors (255, "
                         "128, 255), but a mask must hold class ids in one channel"),
              std::string::npos)
        << error;
    EXPECT_EQ(hddp::decodeImage(dir + name, 3)[1][1][1].item<int>(), 128);  // still an image
  }
}

// A folder of VOC masks: the classes and the targets are the palette's indices.
TEST(ImageMask, SegmentationFolderReadsPaletteMasksAsClassIds) {
  const std::string dir = hddp::testing::makeTempDir();
  std::filesystem::create_directories(dir + "/images");
  std::filesystem::create_directories(dir + "/masks");
  writePng(dir + "/images/a.png", PNG_COLOR_TYPE_GRAY, 8, 3, 2, {9, 9, 9, 9, 9, 9});
  const std::vector<int> mask = {0, 1, 5, 5, 1, 0};
  writePng(dir + "/masks/a.png", PNG_COLOR_TYPE_PALETTE, 8, 3, 2, mask, vocPalette());
  hddp::SegmentationFolderDataset dataset(dir, 1, 0);
  EXPECT_EQ(dataset.classes(), 6);
  hddp::SampleRng rng(1);
  EXPECT_TRUE(dataset.get(0, rng).target.equal(ids(mask, 2, 3)));
}

// maxval 256..65535: two bytes a sample. An image scales them to 8 bits, rounded ("P5 2 1
// 1000" with 200 and 1000 was [0, 3], their high bytes), but at 65535 keeps the high byte
// as a 16-bit PNG does (so 0xff01 is 255 from either); a mask keeps values up to 255.
TEST(ImageMask, PgmAndPpmOfTwoByteSamplesAreScaledInImagesAndKeptInMasks) {
  const std::string dir = hddp::testing::makeTempDir();
  const auto be16 = [](std::initializer_list<int> values) {
    std::string s;
    for (const int v : values) {
      s += static_cast<char>(v >> 8);
      s += static_cast<char>(v & 0xff);
    }
    return s;
  };
  writeFile(dir + "/1000.pgm", "P5 2 1 1000\n" + be16({200, 1000}));
  EXPECT_TRUE(hddp::decodeImage(dir + "/1000.pgm", 1)
                  .equal(torch::tensor({51, 255}, at::kByte).view({1, 1, 2})));
  for (const int maxval : {256, 257, 1000, 4095, 32768, 65534, 65535}) {
    const std::vector<int> v = {0, 1, maxval / 3, maxval / 2, maxval - 1, maxval};
    writeFile(dir + "/a.pgm", "P5 6 1 " + std::to_string(maxval) + "\n" +
                                  be16({v[0], v[1], v[2], v[3], v[4], v[5]}));
    writeFile(dir + "/a.ppm", "P6 2 1 " + std::to_string(maxval) + "\n" +
                                  be16({v[0], v[1], v[2], v[3], v[4], v[5]}));
    std::vector<int> scaled;
    for (const int x : v) {
      scaled.push_back(
          maxval == 65535 ? x >> 8 : static_cast<int>((int64_t{x} * 255 + maxval / 2) / maxval));
    }
    const at::Tensor expected = torch::tensor(scaled, at::kByte);
    EXPECT_TRUE(hddp::decodeImage(dir + "/a.pgm", 1).equal(expected.view({1, 1, 6})))
        << maxval << ": " << hddp::decodeImage(dir + "/a.pgm", 1);
    EXPECT_TRUE(
        hddp::decodeImage(dir + "/a.ppm", 3).equal(expected.view({1, 2, 3}).permute({2, 0, 1})))
        << maxval;
  }
  writeFile(dir + "/mask.pgm", "P5 3 1 1000\n" + be16({0, 7, 200}));
  EXPECT_TRUE(hddp::data::decodeMask(dir + "/mask.pgm", false).equal(ids({0, 7, 200}, 1, 3)));
  writeFile(dir + "/over.pgm", "P5 2 1 1000\n" + be16({7, 256}));
  EXPECT_NE(dataErrorOf([&] {
              hddp::data::decodeMask(dir + "/over.pgm", false);
            }).find("its pixel (x 1, y 0) holds 256; hddp reads class ids 0..255"),
            std::string::npos);
}

// A JPEG cut off inside its scan decoded, its missing part grey (libjpeg's memory source
// makes up an end of image, with a warning that was dropped). Pillow raises "image file is
// truncated"; hddp a DataError that names the file and what to do.
TEST(ImageDecode, TruncatedJpegIsRefusedAsTruncated) {
  const std::string path = sourcePath("data/images/truncated.jpg");
  for (const int channels : {1, 3}) {
    const std::string error = dataErrorOf([&] { hddp::decodeImage(path, channels); });
    EXPECT_NE(error.find("cannot decode image " + path + " (JPEG): the file is truncated"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("re-encode it from the original or remove it"), std::string::npos)
        << error;
  }
  EXPECT_NE(dataErrorOf([&] { hddp::data::decodeMask(path, false); }).find("truncated"),
            std::string::npos);
}

// Other libjpeg warnings (here bytes before a marker) do not stop the decoding; the first
// is logged, once per file however often it is decoded.
TEST(ImageDecode, JpegWarningsAreLoggedOncePerFile) {
  const std::string dir = hddp::testing::makeTempDir();
  std::string jpeg = fileContents(sourcePath("data/images/rgb-444.jpg"));
  const size_t dqt = jpeg.find("\xff\xdb");
  ASSERT_NE(dqt, std::string::npos);
  jpeg.insert(dqt, "\x01\x02", 2);
  writeFile(dir + "/extra.jpg", jpeg);
  std::vector<std::string> lines;
  hddp::log::setLineHandler([&](hddp::log::Level, const std::string& line) {
    if (line.find("extra.jpg") != std::string::npos) {
      lines.push_back(line);
    }
  });
  const at::Tensor reference = hddp::decodeImage(sourcePath("data/images/rgb-444.jpg"), 3);
  bool equal = true;
  for (int i = 0; i < 3; ++i) {
    equal = equal && hddp::decodeImage(dir + "/extra.jpg", 3).equal(reference);
  }
  hddp::log::setLineHandler(nullptr);
  EXPECT_TRUE(equal);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("2 extraneous bytes before marker 0xdb"), std::string::npos) << lines[0];
}

// pngJpegDecoders says the versions it was compiled against, as its header promises.
TEST(ImageDecode, PngJpegDecodersNamesTheirVersions) {
  const std::string decoders = hddp::data::pngJpegDecoders();
  EXPECT_NE(decoders.find(std::string("libpng ") + PNG_LIBPNG_VER_STRING), std::string::npos)
      << decoders;
  EXPECT_NE(decoders.find("libjpeg"), std::string::npos) << decoders;
  EXPECT_NE(decoders.find("(libjpeg API "), std::string::npos) << decoders;
}

}  // namespace
