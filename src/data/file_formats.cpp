// File formats: reading (gzip-compressed) files, IDX (MNIST, Fashion-MNIST) and the
// CIFAR-10 binary batches.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "data/image_io.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"

#ifdef HDDP_HAVE_ZLIB
#include <zlib.h>
#endif

namespace fs = std::filesystem;

namespace hddp {
namespace data {

std::vector<uint8_t> readFile(const std::string& path) {
  const bool gz = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
  std::vector<uint8_t> out;
  if (gz) {
#ifdef HDDP_HAVE_ZLIB
    gzFile f = gzopen(path.c_str(), "rb");
    HDDP_CHECK_AS(DataError, f != nullptr, "cannot open ", path);
    uint8_t buffer[1 << 16];
    int n = 0;
    while ((n = gzread(f, buffer, sizeof(buffer))) > 0) {
      out.insert(out.end(), buffer, buffer + n);
    }
    int err = 0;
    const char* raw = gzerror(f, &err);
    std::string message = raw ? raw : "";  // owned by f: copy before gzclose
    if (message.rfind(path + ": ", 0) == 0) {
      message.erase(0, path.size() + 2);  // zlib prefixes the path, which we name anyway
    }
    gzclose(f);
    HDDP_CHECK_AS(DataError, n == 0 && (err == Z_OK || err == Z_STREAM_END), "cannot decompress ",
                  path, " (zlib: ", message.empty() ? "error " + std::to_string(err) : message,
                  ") after ", out.size(),
                  " bytes: ", err == Z_BUF_ERROR ? "the file is truncated" : "the file is corrupt",
                  "; download or copy it again");
    return out;
#else
    HDDP_THROW(DataError, path,
               " is gzip-compressed but hddp was built without zlib: gunzip it, or "
               "install zlib1g-dev and rebuild");
#endif
  }
  std::ifstream in(path, std::ios::binary);
  HDDP_CHECK_AS(DataError, in.good(), "cannot open ", path);
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return out;
}

// `base` or `base`.gz, whichever exists.
std::string findFile(const std::string& dir, const std::string& base) {
  for (const char* suffix : {"", ".gz"}) {
    const fs::path p = fs::path(dir) / (base + suffix);
    if (fs::exists(p)) {
      return p.string();
    }
  }
  HDDP_THROW(DataError, "neither ", base, " nor ", base, ".gz in ", dir,
             " (for Fashion-MNIST: apt-get install dataset-fashion-mnist, which puts them "
             "in /usr/share/datasets/fashion-mnist)");
}

uint32_t bigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace data

using data::bigEndian32;
using data::findFile;
using data::readFile;

// ---- IDX / MNIST --------------------------------------------------------------------

at::Tensor readIdx(const std::string& path) {
  const std::vector<uint8_t> bytes = readFile(path);
  HDDP_CHECK_AS(DataError, bytes.size() >= 4 && bytes[0] == 0 && bytes[1] == 0, path,
                " is not an IDX file (bad magic number)");
  const uint8_t type = bytes[2];
  const int dims = bytes[3];
  HDDP_CHECK_AS(DataError, dims >= 1 && dims <= 8 && bytes.size() >= 4 + 4 * size_t(dims), path,
                ": IDX header claims ", dims, " dimensions");
  // Each dimension is below 2^32 and the file holds every element, so a product above
  // the file's size is refused before it can overflow.
  // Beside a 0, the other dimensions still make the tensor's strides: their product
  // (LibTorch's, each at least 1) must stay within int64 too.
  std::vector<int64_t> shape;
  int64_t count = 1;
  int64_t span = 1;
  for (int d = 0; d < dims; ++d) {
    shape.push_back(bigEndian32(&bytes[4 + 4 * d]));
    if (shape.back() != 0 && count > static_cast<int64_t>(bytes.size()) / shape.back()) {
      HDDP_THROW(DataError, path, " is truncated: its IDX header claims more elements than its ",
                 bytes.size(), " bytes can hold");
    }
    count *= shape.back();
    const int64_t extent = std::max<int64_t>(shape.back(), 1);
    HDDP_CHECK_AS(DataError, span <= (int64_t{1} << 62) / extent, path, ": its IDX header's shape ",
                  c10::IntArrayRef(shape), "... spans more than 2^62 elements");
    span *= extent;
  }
  at::ScalarType dtype;
  size_t width = 1;
  switch (type) {
    case 0x08:
      dtype = at::kByte;
      break;
    case 0x09:
      dtype = at::kChar;
      break;
    case 0x0B:
      dtype = at::kShort;
      width = 2;
      break;
    case 0x0C:
      dtype = at::kInt;
      width = 4;
      break;
    case 0x0D:
      dtype = at::kFloat;
      width = 4;
      break;
    case 0x0E:
      dtype = at::kDouble;
      width = 8;
      break;
    default:
      HDDP_THROW(DataError, path, ": unknown IDX element type 0x", std::hex, int(type));
  }
  const size_t header = 4 + 4 * size_t(dims);
  const size_t expected = header + size_t(count) * width;
  HDDP_CHECK_AS(DataError, bytes.size() == expected, path,
                " is truncated or has trailing bytes: ", bytes.size(),
                " bytes, the header's shape needs ", expected);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const uint8_t* src = bytes.data() + header;
  if (count == 0) {
    return out;  // no elements (and no storage to copy into)
  }
  if (width == 1) {
    std::memcpy(dst, src, size_t(count));
  } else {
    for (int64_t i = 0; i < count; ++i) {  // big-endian elements
      for (size_t b = 0; b < width; ++b) {
        dst[size_t(i) * width + b] = src[size_t(i) * width + (width - 1 - b)];
      }
    }
  }
  return out;
}

std::shared_ptr<ImageClassificationDataset> loadMnist(const std::string& dir, Split split) {
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::string imagesPath = findFile(dir, prefix + "-images-idx3-ubyte");
  const std::string labelsPath = findFile(dir, prefix + "-labels-idx1-ubyte");
  at::Tensor images = readIdx(imagesPath);
  at::Tensor labels = readIdx(labelsPath);
  HDDP_CHECK_AS(DataError, images.dim() == 3 && images.scalar_type() == at::kByte, imagesPath,
                ": expected uint8 images [N, H, W], got ", images.sizes());
  HDDP_CHECK_AS(DataError, labels.dim() == 1 && labels.size(0) == images.size(0), labelsPath, ": ",
                labels.numel(), " labels for ", images.size(0), " images in ", imagesPath);
  const std::string name =
      std::string(fs::path(dir).filename().string().find("fashion") != std::string::npos
                      ? "Fashion-MNIST"
                      : "MNIST") +
      (split == Split::Train ? " train" : " test");
  return std::make_shared<ImageClassificationDataset>(images.unsqueeze(1), labels, 10, name);
}

std::shared_ptr<ImageClassificationDataset> loadCifar10(const std::string& dir, Split split) {
  std::string root = dir;
  if (!fs::exists(fs::path(root) / "test_batch.bin") &&
      fs::exists(fs::path(root) / "cifar-10-batches-bin")) {
    root = (fs::path(root) / "cifar-10-batches-bin").string();
  }
  std::vector<std::string> files;
  if (split == Split::Train) {
    for (int i = 1; i <= 5; ++i) {
      files.push_back((fs::path(root) / ("data_batch_" + std::to_string(i) + ".bin")).string());
    }
  } else {
    files.push_back((fs::path(root) / "test_batch.bin").string());
  }
  constexpr size_t kRecord = 1 + 3 * 32 * 32;
  std::vector<uint8_t> all;
  for (const auto& f : files) {
    HDDP_CHECK_AS(DataError, fs::exists(f), "CIFAR-10: ", f,
                  " not found (expected the binary version, cifar-10-binary.tar.gz, unpacked)");
    auto bytes = readFile(f);
    HDDP_CHECK_AS(DataError, !bytes.empty() && bytes.size() % kRecord == 0, "CIFAR-10: ", f,
                  " has ", bytes.size(), " bytes, not a multiple of the ", kRecord, "-byte record");
    all.insert(all.end(), bytes.begin(), bytes.end());
  }
  const int64_t n = static_cast<int64_t>(all.size() / kRecord);
  at::Tensor raw = at::from_blob(all.data(), {n, static_cast<int64_t>(kRecord)}, at::kByte).clone();
  at::Tensor labels = raw.select(1, 0).to(at::kLong);
  at::Tensor images = raw.narrow(1, 1, 3 * 32 * 32).reshape({n, 3, 32, 32}).contiguous();
  return std::make_shared<ImageClassificationDataset>(
      images, labels, 10, std::string("CIFAR-10 ") + (split == Split::Train ? "train" : "test"));
}

}  // namespace hddp
