// ZeRO's optimizer-state parts on their way to the state file's writers
// (trainer_state.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "train/trainer_state.h"

namespace hddp {
namespace train {

std::vector<std::vector<uint8_t>> partsToWriters(Communicator& comm,
                                                 const std::vector<uint8_t>& mine, bool writer) {
  constexpr int64_t kChunk = int64_t{16} << 20;
  const auto sizes = allgatherValue<int64_t>(comm, static_cast<int64_t>(mine.size()));
  const c10::Device device = comm.device();
  std::vector<std::vector<uint8_t>> out(sizes.size());
  for (size_t r = 0; r < sizes.size(); ++r) {
    const int64_t total = sizes[r];
    const bool own = static_cast<int>(r) == comm.rank();
    if (writer) {
      out[r].resize(static_cast<size_t>(total));
    }
    for (int64_t offset = 0; offset < total; offset += kChunk) {
      const int64_t n = std::min(kChunk, total - offset);
      at::Tensor chunk;
      if (own) {
        chunk = at::from_blob(const_cast<uint8_t*>(mine.data()) + offset, {n}, at::kByte)
                    .to(device, /*non_blocking=*/false, /*copy=*/true);
      } else {
        chunk = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device));
      }
      comm.broadcast(chunk, static_cast<int>(r)).wait();
      if (writer) {
        comm.synchronize();
        const at::Tensor host = chunk.cpu();
        std::memcpy(out[r].data() + offset, host.data_ptr<uint8_t>(), static_cast<size_t>(n));
      }
    }
  }
  return out;
}

}  // namespace train
}  // namespace hddp
