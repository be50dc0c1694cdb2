// Dataset readers on small files the tests write, and on the real Fashion-MNIST files
// when Debian's dataset-fashion-mnist is installed.
#include "hddp/data/datasets.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "hddp/core/error.h"
#include "support/ranks.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
#include <stb/stb_image_write.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace fs = std::filesystem;

namespace {

std::string idxBytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data) {
  std::string out{0, 0, 0x08, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int s = 24; s >= 0; s -= 8) {
      out.push_back(static_cast<char>((d >> s) & 0xFF));
    }
  }
  out.append(data.begin(), data.end());
  return out;
}

void writeFile(const std::string& path, const std::string& bytes, bool gz) {
  if (gz) {
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

// A tiny MNIST-like folder: n images 28x28 whose pixels encode their index, labels i % 10.
std::string makeMnistDir(int n, bool gz) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<uint8_t> pixels(static_cast<size_t>(n) * 28 * 28);
  std::vector<uint8_t> labels(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    for (int p = 0; p < 28 * 28; ++p) {
      pixels[static_cast<size_t>(i) * 784 + p] = static_cast<uint8_t>((i * 7 + p) % 256);
    }
    labels[static_cast<size_t>(i)] = static_cast<uint8_t>(i % 10);
  }
  const std::string suffix = gz ? ".gz" : "";
  for (const char* split : {"train", "t10k"}) {
    writeFile(dir + "/" + split + "-images-idx3-ubyte" + suffix,
              idxBytes({static_cast<uint32_t>(n), 28, 28}, pixels), gz);
    writeFile(dir + "/" + split + "-labels-idx1-ubyte" + suffix,
              idxBytes({static_cast<uint32_t>(n)}, labels), gz);
  }
  return dir;
}

template <typename Fn>
std::string errorOf(Fn&& fn) {
  try {
    fn();
  } catch (const hddp::DataError& e) {
    return e.what_without_backtrace();
  }
  return "(no DataError)";
}

}  // namespace

TEST(Datasets, IdxGzipAndPlainReadTheSame) {
  for (bool gz : {false, true}) {
    const std::string dir = makeMnistDir(12, gz);
    auto train = hddp::loadMnist(dir, hddp::Split::Train);
    ASSERT_EQ(train->size(), 12);
    EXPECT_EQ(train->channels(), 1);
    EXPECT_EQ(train->height(), 28);
    EXPECT_EQ(train->labels()[7].item<int64_t>(), 7);
    EXPECT_EQ(train->images()[3][0][0][5].item<uint8_t>(), (3 * 7 + 5) % 256);
    hddp::SampleRng rng(0);
    auto ex = train->get(3, rng);
    EXPECT_EQ(ex.input.sizes(), (std::vector<int64_t>{1, 28, 28}));
    EXPECT_EQ(ex.input.scalar_type(), at::kFloat);
    EXPECT_NEAR(ex.input[0][0][5].item<float>(), ((3 * 7 + 5) % 256) / 255.0f, 1e-6);
    EXPECT_EQ(ex.target.item<int64_t>(), 3);
  }
}

TEST(Datasets, BadIdxFilesNameTheProblem) {
  const std::string dir = hddp::testing::makeTempDir();
  writeFile(dir + "/bad.idx", "PK\x03\x04garbage", false);
  EXPECT_NE(errorOf([&] { hddp::readIdx(dir + "/bad.idx"); }).find("bad magic"), std::string::npos);
  std::string truncated = idxBytes({4, 28, 28}, std::vector<uint8_t>(100));
  writeFile(dir + "/short.idx", truncated, false);
  const std::string message = errorOf([&] { hddp::readIdx(dir + "/short.idx"); });
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  EXPECT_NE(message.find("short.idx"), std::string::npos) << message;
  EXPECT_NE(
      errorOf([&] { hddp::loadMnist(dir, hddp::Split::Train); }).find("train-images-idx3-ubyte"),
      std::string::npos);
}

// A cut-off download: zlib's own words and the file, not a pointer into freed memory.
TEST(Datasets, TruncatedGzipSaysWhatZlibSaidAndWhichFile) {
  const std::string dir = makeMnistDir(40, true);
  const std::string path = dir + "/train-images-idx3-ubyte.gz";
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  ASSERT_EQ(truncate(path.c_str(), st.st_size / 2), 0);
  const std::string message = errorOf([&] { hddp::loadMnist(dir, hddp::Split::Train); });
  EXPECT_NE(message.find("train-images-idx3-ubyte.gz"), std::string::npos) << message;
  EXPECT_NE(message.find("(zlib: unexpected end of file)"), std::string::npos) << message;
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
}

TEST(Datasets, RealFashionMnistWhenInstalled) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist not installed";
  }
  auto train = hddp::loadMnist(dir, hddp::Split::Train);
  auto test = hddp::loadMnist(dir, hddp::Split::Test);
  EXPECT_EQ(train->size(), 60000);
  EXPECT_EQ(test->size(), 10000);
  EXPECT_NE(train->describe().find("Fashion-MNIST"), std::string::npos);
  // Balanced: 6000 of each class in the training set.
  auto counts = at::bincount(train->labels());
  EXPECT_EQ(counts.size(0), 10);
  EXPECT_EQ(counts.min().item<int64_t>(), 6000);
  EXPECT_EQ(counts.max().item<int64_t>(), 6000);
  auto [mean, std] = train->channelStats();
  EXPECT_NEAR(mean[0], 0.286, 0.01);  // the usual Fashion-MNIST normalisation
  EXPECT_NEAR(std[0], 0.353, 0.01);
}

TEST(Datasets, Cifar10BinaryLayout) {
  const std::string dir = hddp::testing::makeTempDir();
  fs::create_directories(dir + "/cifar-10-batches-bin");
  std::string bytes;
  for (int i = 0; i < 5; ++i) {
    bytes.push_back(static_cast<char>(i % 10));
    for (int c = 0; c < 3; ++c) {
      bytes.append(1024, static_cast<char>(10 * i + c));  // plane c filled with 10i + c
    }
  }
  writeFile(dir + "/cifar-10-batches-bin/test_batch.bin", bytes, false);
  auto test = hddp::loadCifar10(dir, hddp::Split::Test);
  ASSERT_EQ(test->size(), 5);
  EXPECT_EQ(test->channels(), 3);
  EXPECT_EQ(test->labels()[4].item<int64_t>(), 4);
  EXPECT_EQ(test->images()[2][1][31][31].item<uint8_t>(), 21);
  EXPECT_NE(errorOf([&] { hddp::loadCifar10(dir, hddp::Split::Train); }).find("data_batch_1.bin"),
            std::string::npos);
  writeFile(dir + "/cifar-10-batches-bin/test_batch.bin", bytes.substr(0, 5000), false);
  EXPECT_NE(errorOf([&] { hddp::loadCifar10(dir, hddp::Split::Test); }).find("multiple"),
            std::string::npos);
}

TEST(Datasets, ImageFolderDecodesResizesAndLabelsBySubfolder) {
  const std::string dir = hddp::testing::makeTempDir();
  for (const char* cls : {"cat", "dog"}) {
    fs::create_directories(dir + "/" + cls);
  }
  std::vector<uint8_t> rgb(20 * 10 * 3);
  for (size_t i = 0; i < rgb.size(); ++i) {
    rgb[i] = static_cast<uint8_t>(i % 3 == 0 ? 255 : 0);  // pure red
  }
  ASSERT_TRUE(stbi_write_png((dir + "/cat/a.png").c_str(), 20, 10, 3, rgb.data(), 20 * 3));
  ASSERT_TRUE(stbi_write_png((dir + "/dog/b.png").c_str(), 20, 10, 3, rgb.data(), 20 * 3));
  ASSERT_TRUE(stbi_write_bmp((dir + "/dog/c.bmp").c_str(), 20, 10, 3, rgb.data()));
  std::ofstream(dir + "/dog/notes.txt") << "not an image";
  hddp::ImageFolderDataset folder(dir, 3, 16);
  ASSERT_EQ(folder.size(), 3);
  EXPECT_EQ(folder.classNames(), (std::vector<std::string>{"cat", "dog"}));
  hddp::SampleRng rng(0);
  auto ex = folder.get(2, rng);
  EXPECT_EQ(ex.input.sizes(), (std::vector<int64_t>{3, 16, 16}));
  EXPECT_EQ(ex.target.item<int64_t>(), 1);
  EXPECT_NEAR(ex.input[0].mean().item<float>(), 1.0f, 1e-5);
  EXPECT_NEAR(ex.input[1].mean().item<float>(), 0.0f, 1e-5);
  std::ofstream(dir + "/cat/broken.png") << "not a png";
  hddp::ImageFolderDataset withBroken(dir, 3, 16);
  EXPECT_NE(errorOf([&] { withBroken.get(1, rng); }).find("broken.png"), std::string::npos);
}

// decodeImage refuses, before decoding, an image over its ImageLimits and one claiming
// more pixels than its bytes can describe (stb_image would allocate and fill them); the
// same image within both decodes.
TEST(Datasets, DecodeImageRefusesClaimsBeyondItsLimitsOrBytes) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<uint8_t> rgb(20 * 10 * 3, 200);
  const std::string png = dir + "/a.png";
  ASSERT_TRUE(stbi_write_png(png.c_str(), 20, 10, 3, rgb.data(), 20 * 3));
  EXPECT_EQ(hddp::decodeImage(png, 3, hddp::ImageLimits{200}).sizes(),
            (std::vector<int64_t>{3, 10, 20}));
  EXPECT_NE(errorOf([&] {
              hddp::decodeImage(png, 3, hddp::ImageLimits{199});
            }).find("20x10 (200 pixels), more than the limit of 199"),
            std::string::npos);
  // A BMP of 2x2 pixels whose header says 4000x4000: 16 million pixels from 70 bytes.
  const std::string bmp = dir + "/b.bmp";
  ASSERT_TRUE(stbi_write_bmp(bmp.c_str(), 2, 2, 3, rgb.data()));
  std::fstream f(bmp, std::ios::in | std::ios::out | std::ios::binary);
  const char size[4] = {static_cast<char>(0xa0), 0x0f, 0, 0};  // 4000, little-endian
  f.seekp(18).write(size, 4).seekp(22).write(size, 4);
  f.close();
  EXPECT_NE(errorOf([&] {
              hddp::decodeImage(bmp, 3);
            }).find("4000x4000 pixels, more than its 70 bytes can describe as BMP"),
            std::string::npos);
}

TEST(Datasets, SegmentationFolderBinaryMasksAndMatchedCrops) {
  const std::string dir = hddp::testing::makeTempDir();
  fs::create_directories(dir + "/images");
  fs::create_directories(dir + "/masks");
  std::vector<uint8_t> gray(12 * 12);
  std::vector<uint8_t> mask(12 * 12);
  for (int y = 0; y < 12; ++y) {
    for (int x = 0; x < 12; ++x) {
      const bool on = x >= 6;
      gray[y * 12 + x] = on ? 200 : 10;
      mask[y * 12 + x] = on ? 255 : 0;
    }
  }
  ASSERT_TRUE(stbi_write_png((dir + "/images/s1.png").c_str(), 12, 12, 1, gray.data(), 12));
  ASSERT_TRUE(stbi_write_png((dir + "/masks/s1.png").c_str(), 12, 12, 1, mask.data(), 12));
  hddp::SegmentationFolderDataset seg(dir, 1, 0);
  EXPECT_EQ(seg.classes(), 2);
  hddp::ImageTransform t;
  t.padCrop = 3;
  t.horizontalFlip = true;
  seg.setTransform(t);
  for (int seed = 0; seed < 8; ++seed) {
    hddp::SampleRng rng(seed);
    auto ex = seg.get(0, rng);
    ASSERT_EQ(ex.target.sizes(), (std::vector<int64_t>{12, 12}));
    // The mask follows the image through the same crop and flip.
    EXPECT_TRUE(at::equal((ex.input[0] > 0.5).to(at::kLong), ex.target)) << "seed " << seed;
  }
  fs::remove(dir + "/masks/s1.png");
  EXPECT_NE(errorOf([&] { hddp::SegmentationFolderDataset(dir, 1, 0); }).find("no mask"),
            std::string::npos);
}

TEST(Datasets, SyntheticSetsAreSeededAndWellFormed) {
  hddp::SyntheticShapesDataset shapes(10, 32, /*seed=*/5);
  hddp::SampleRng a(1);
  hddp::SampleRng b(99);
  auto x = shapes.get(3, a);
  auto y = shapes.get(3, b);
  EXPECT_TRUE(at::equal(x.input, y.input));
  EXPECT_TRUE(at::equal(x.target, y.target));
  EXPECT_EQ(x.target.sizes(), (std::vector<int64_t>{32, 32}));
  EXPECT_GE(x.target.min().item<int64_t>(), 0);
  EXPECT_LE(x.target.max().item<int64_t>(), 2);
  EXPECT_GT((x.target > 0).sum().item<int64_t>(), 0);  // at least one shape
  hddp::SyntheticClassificationDataset cls(50, 3, 16, 4, 1);
  auto c = cls.get(7, a);
  EXPECT_EQ(c.input.sizes(), (std::vector<int64_t>{3, 16, 16}));
  EXPECT_LT(c.target.item<int64_t>(), 4);
}

TEST(Datasets, CollateRejectsMixedShapes) {
  std::vector<hddp::Example> examples{{at::zeros({3, 4}), at::scalar_tensor(1)},
                                      {at::zeros({3, 5}), at::scalar_tensor(2)}};
  EXPECT_NE(errorOf([&] { hddp::collate(examples); }).find("different shapes"), std::string::npos);
  examples[1].input = at::ones({3, 4});
  auto batch = hddp::collate(examples);
  EXPECT_EQ(batch.input.sizes(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(batch.input[1].sum().item<float>(), 12.0f);
}
