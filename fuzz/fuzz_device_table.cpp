// The what-if device table (src/balance/device_table.cpp): a JSON file of devices, links
// and published figures that users add to hddp's own (hddp-probe --device-table), parsed
// by hddp::DeviceTable::parse; then a mix of its first device and link is parsed, as
// hddp-probe --what-if does, and the table is merged into another.
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp/balance/device_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  hddp::fuzz::refusedCleanly("DeviceTable::parse", [&] {
    hddp::DeviceTable table = hddp::DeviceTable::parse(text, "fuzz/devices.json");
    if (!table.devices().empty()) {
      std::string mix = table.devices().begin()->first;
      if (!table.links().empty()) {
        mix += "@" + table.links().begin()->first;
      }
      hddp::fuzz::refusedCleanly("DeviceTable::parseMix", [&] { table.parseMix(mix + "," + mix); });
    }
    hddp::DeviceTable other;
    other.merge(table);
  });
  return 0;
}
