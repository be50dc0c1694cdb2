// hddp-probe --what-if's output (what_if.cpp runs it): the prediction of
// hddp::predictMix as a table, as JSON and as an SVG chart, and the device table's list.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "hddp/balance/device_table.h"
#include "hddp/balance/what_if.h"
#include "what_if.h"

namespace hddp_probe {

/// The prediction, the model's profile and the settings as --json prints them.
nlohmann::json toJson(const hddp::WhatIfResult& r, const hddp::ModelProfile& p,
                      const WhatIfOptions& o);

/// The prediction as a table per device, the allreduce, the peers and the advice.
void printTable(const hddp::WhatIfResult& r, const hddp::ModelProfile& p, const WhatIfOptions& o);

/// Per-device time of a step as stacked bars (--svg).
std::string svgChart(const hddp::WhatIfResult& r, const hddp::ModelProfile& p);

/// --list-devices: the table's cards and links.
void listDevices(const hddp::DeviceTable& table);

}  // namespace hddp_probe
