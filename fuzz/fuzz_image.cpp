// Image decoding (src/data/image_decode.cpp and the decoders it picks by the first bytes:
// libpng for PNG, libjpeg-turbo for JPEG, hddp's own reader for PGM/PPM, stb_image for
// GIF, BMP and TGA): hddp::decodeImage with 3 channels (the image folder datasets) and
// data::decodeMask (the segmentation masks: class ids as the file stores them, a palette
// PNG's indices, 16-bit values up to 255, RGB only where its colors are equal; 0/255
// masks to 0/1).
//
// Beyond the rule of fuzz_support.h: a decoded image is [C, H, W] uint8 with C as asked.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "data/image_io.h"
#include "fuzz_support.h"
#include "hddp/data/datasets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = hddp::fuzz::writeInput(data, size, "input.img");
  hddp::fuzz::refusedCleanly("decodeImage", [&] {
    const at::Tensor image = hddp::decodeImage(path, 3);
    if (image.dim() != 3 || image.size(0) != 3 || image.scalar_type() != at::kByte) {
      hddp::fuzz::finding("decodeImage", "contract", "not a [3, H, W] uint8 image");
    }
  });
  hddp::fuzz::refusedCleanly("decodeMask", [&] {
    const at::Tensor mask = hddp::data::decodeMask(path, /*binary255=*/true);
    if (mask.dim() != 2 || (mask.numel() > 0 && mask.max().item<int64_t>() > 1)) {
      hddp::fuzz::finding("decodeMask", "contract", "not an [H, W] mask of 0 and 1");
    }
  });
  return 0;
}
