// hddp's state files (src/train/state_file.cpp and the Trainer's load behind it,
// trainer_state_load.cpp / trainer_state.cpp): each input is read twice.
//  1. As it is, by hddp::readStateFile: magic, announced length, CRC-32.
//  2. With its length and CRC set to match its payload (the input's bytes after the
//     20-byte header), by Trainer::load of a one-rank job, so that the fuzzer's mutations
//     reach the payload -- the LibTorch archive with meta, progress, model, optimizer,
//     scaler, sampler, planner, each rank's part and the Trainer's parts' states (a part
//     with a state of its own, hddp/train/part.h) -- rather than stopping at the CRC.
//  3. The same bytes as a commit of hddp::Commits (hddp/train/commits.h), resumed.
//
// The job: Linear(4, 3) + BatchNorm1d(3), SGD with momentum, balancing on, global batch 8,
// one rank over Gloo on the CPU. HDDP_FUZZ_WRITE_SEED=<dir> makes this program train it
// for 3 steps, save its state file and a commit of its model into <dir> (the seed
// corpus's) and exit.
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "fuzz_support.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/store.h"
#include "hddp/data/datasets.h"
#include "hddp/train/commits.h"
#include "hddp/train/part.h"
#include "hddp/train/state_file.h"
#include "hddp/train/trainer.h"

namespace {

constexpr size_t kHeader = 20;  // "HDDPST01", length (uint64), CRC-32 (uint32)

// A part of the Trainer with a state of its own: its bytes, taken as they come.
class KeptBytes final : public hddp::TrainerPart {
 public:
  std::string name() const override { return "kept_bytes"; }
  int stateVersion() const override { return 2; }
  std::string saveState() const override { return bytes_; }
  void loadState(const std::string& bytes, int version) override {
    bytes_ = bytes;
    version_ = version;
  }

 private:
  std::string bytes_ = "state of the part";
  int version_ = 2;
};

struct OneRankJob {
  hddp::Store store = hddp::Store::memory(std::chrono::seconds(60));
  std::unique_ptr<hddp::Communicator> comm = hddp::makeCommunicator(store, 0, 1);
  torch::nn::Sequential net{torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3)};
  torch::optim::SGD optimizer{net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  std::unique_ptr<hddp::Trainer> trainer;

  explicit OneRankJob(const std::string& saveDir) {
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.epochs = 1;
    o.maxSteps = 3;
    o.seedPlan = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.saveDir = saveDir;
    o.keepLast = 1;
    auto data = std::make_shared<hddp::SyntheticClassificationDataset>(32, 1, 2, 3, /*seed=*/5);
    auto flat = net;
    trainer = std::make_unique<hddp::Trainer>(
        *comm, net.ptr(),
        [flat](const at::Tensor& x) mutable { return flat->forward(x.flatten(1)); },
        hddp::crossEntropy(), optimizer, data, o);
    trainer->addPart(std::make_shared<KeptBytes>());
  }
};

OneRankJob*& theJob() {
  static OneRankJob* job = new OneRankJob("");  // never destroyed: fuzzing ends in exit()
  return job;
}

OneRankJob& job() { return *theJob(); }

// A load refused after it began to copy the file in leaves the Trainer refusing every
// call (half loaded): the next input gets a fresh job. Any refused load does, since which
// one it was is not told; a job is cheap to make.
void renewJob() {
  delete theJob();
  theJob() = new OneRankJob("");
}

void putLittleEndian(std::string& bytes, size_t at, uint64_t value, int n) {
  for (int i = 0; i < n; ++i) {
    bytes[at + static_cast<size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("HDDP_LOG_LEVEL", "off", 0);
  setenv("HDDP_DEVICE", "cpu", 0);
  if (const char* dir = std::getenv("HDDP_FUZZ_WRITE_SEED")) {
    OneRankJob seed(dir);
    seed.trainer->fit();
    hddp::Commits(*seed.comm, dir).save(3, [&](torch::serialize::OutputArchive& a) {
      seed.net->save(a);
    });
    std::printf("wrote the state file and a commit of 3 steps into %s\n", dir);
    std::exit(0);
  }
  job();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw = hddp::fuzz::writeInput(data, size, "state-00000001.hddp");
  hddp::fuzz::refusedCleanly("readStateFile", [&] { hddp::readStateFile(raw); });
  if (size < kHeader || std::string(reinterpret_cast<const char*>(data), 8) != "HDDPST01") {
    return 0;
  }
  std::string fixed(reinterpret_cast<const char*>(data), size);
  putLittleEndian(fixed, 8, size - kHeader, 8);
  putLittleEndian(fixed, 16, hddp::crc32Of(fixed.data() + kHeader, size - kHeader), 4);
  const std::string path = hddp::fuzz::writeInput(reinterpret_cast<const uint8_t*>(fixed.data()),
                                                  fixed.size(), "state-00000002.hddp");
  if (!hddp::fuzz::refusedCleanly("Trainer::load", [&] { job().trainer->load(path); })) {
    renewJob();
  }
  const std::string commit = hddp::fuzz::writeInput(reinterpret_cast<const uint8_t*>(fixed.data()),
                                                    fixed.size(), "commit-00000002.hddp");
  hddp::fuzz::refusedCleanly("Commits::resume", [&] {
    hddp::Commits commits(*job().comm, commit.substr(0, commit.rfind('/')));
    commits.resume([](torch::serialize::InputArchive&) {});
  });
  return 0;
}
