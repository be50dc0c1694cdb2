// Internal helpers of the data layer: reading (possibly gzip-compressed) files, and
// image operations shared by the dataset classes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace hddp {
namespace data {

/// The whole file; a ".gz" name is decompressed (hddp::DataError naming a truncated or
/// corrupt file).
std::vector<uint8_t> readFile(const std::string& path);
/// `base` or `base`.gz in `dir`, whichever exists; DataError when neither does.
std::string findFile(const std::string& dir, const std::string& base);
uint32_t bigEndian32(const uint8_t* p);

/// A file name with a known image extension (png, jpg, bmp, tga, gif, pgm, ppm).
bool isImageFile(const std::filesystem::path& p);
/// uint8 [0, 255] -> float [0, 1].
at::Tensor toFloatImage(const at::Tensor& u8);
/// [C, H, W] float -> size x size (bilinear), or as is when size <= 0 or already that size.
at::Tensor resizeImage(const at::Tensor& image, int size);
/// [H, W] class indices -> size x size (nearest).
at::Tensor resizeMask(const at::Tensor& mask, int size);
/// A mask image as [H, W] int64 class ids, as the file stores them (data::toClassIds: a
/// palette PNG's indices, gray values; RGB only where its colors are equal, else a
/// DataError); `binary255`: 0/255 masks become 0/1.
at::Tensor decodeMask(const std::string& path, bool binary255);

}  // namespace data
}  // namespace hddp
