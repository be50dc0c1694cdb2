// The device table for what-if planning (docs/egpu.md, "Choosing an enclosure"): GPUs
// with their peak throughput, memory and memory bandwidth, and host links with their
// usable bandwidth, each with its source. The table is data (data/devices.json,
// installed as share/hddp/devices.json); users add or override entries with a file of
// their own in the same format.
//
//   {"devices": {"rtx4090": {"name": "GeForce RTX 4090", "fp32_tflops": 82.6,
//                            "fp16_tflops": 165.2, "bf16_tflops": 165.2,
//                            "memory_gib": 24, "memory_GBps": 1008, "source": "..."}},
//    "links":   {"tb3": {"name": "Thunderbolt 3 (PCIe 3.0 x4 tunnel)", "GBps": 2.8,
//                        "source": "..."}}}
//
// fp16_tflops and bf16_tflops are the dense tensor-core rates with FP32 accumulation
// (what autocast training runs at); 0 means the card has no such path (bf16 on Turing).
//
// "published" lists training throughputs that others measured on cards of the table, each
// with its source: what the uncalibrated what-if prediction is checked against (its
// default efficiency and memory-traffic factor are fitted to them; docs/balance.md).
//
//   "published": [{"device": "v100", "model": "resnet50", "input": "3x224x224",
//                  "amp": "fp16", "batch": 256, "samples_per_second": 1200,
//                  "source": "..."}]
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hddp {

struct DeviceSpec {
  std::string key;  // "rtx4090"
  std::string name;
  double fp32Tflops = 0;
  double fp16Tflops = 0;  // 0: none
  double bf16Tflops = 0;  // 0: none
  double memoryGiB = 0;
  double memoryGBps = 0;
  std::string source;
};

struct LinkSpec {
  std::string key;  // "pcie4x16", "tb3"
  std::string name;
  double GBps = 0;  // usable host-to-device bandwidth
  std::string source;
};

/// A training throughput measured by others on one card of the table (one GPU, the
/// whole model's training step, samples per second), with where it was published.
struct PublishedFigure {
  std::string device;  // a key of the table's devices
  std::string model;   // hddp-probe --model's name: "resnet50"
  std::string input;   // one sample's shape, "3x224x224"
  std::string amp;     // "off", "fp16" or "bf16"
  int64_t batch = 0;
  double samplesPerSecond = 0;
  std::string source;
};

/// One entry of a what-if mix: a device on a link ("rtx3060@tb3").
struct MixEntry {
  DeviceSpec device;
  LinkSpec link;
};

class DeviceTable {
 public:
  /// Parses the JSON text of a table; `origin` names it in errors. Throws
  /// hddp::ConfigError naming the file, the entry and the field for malformed JSON, a
  /// missing or unknown field, a number that is not positive (or negative, for the
  /// fp16/bf16 rates, where 0 means none), or an entry without a source.
  static DeviceTable parse(const std::string& text, const std::string& origin);
  /// Reads and parses a file (ConfigError when it cannot be read).
  static DeviceTable load(const std::string& path);
  /// The table shipped with hddp: HDDP_DEVICE_TABLE when set, else share/hddp/devices.json
  /// next to the installed library, else the source tree's data/devices.json.
  static DeviceTable builtIn();

  /// Adds `other`'s entries; an entry with the same key replaces this table's; published
  /// figures are appended.
  void merge(const DeviceTable& other);

  /// The entry for `key` (case-insensitive); ConfigError listing the known keys (and
  /// the closest one) when there is none.
  const DeviceSpec& device(const std::string& key) const;
  const LinkSpec& link(const std::string& key) const;
  const std::map<std::string, DeviceSpec>& devices() const { return devices_; }
  const std::map<std::string, LinkSpec>& links() const { return links_; }
  /// The published training figures (a merged table keeps both tables' lists).
  const std::vector<PublishedFigure>& published() const { return published_; }

  /// Parses a mix, "rtx4090@pcie4x16,rtx3060@tb3" (a device without "@link" sits on
  /// `defaultLink`); ConfigError naming the item that is wrong.
  std::vector<MixEntry> parseMix(const std::string& spec,
                                 const std::string& defaultLink = "pcie4x16") const;

 private:
  std::map<std::string, DeviceSpec> devices_;
  std::map<std::string, LinkSpec> links_;
  std::vector<PublishedFigure> published_;
};

}  // namespace hddp
