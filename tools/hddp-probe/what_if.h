// hddp-probe --what-if: predicts a mix of the device table's cards and links for a model
// (hddp/balance/what_if.h), as a table, JSON and an SVG chart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hddp/balance/what_if.h"

namespace CLI {
class App;
}

namespace hddp_probe {

struct WhatIfOptions {
  std::string spec;         // "rtx4090@pcie4x16,rtx3060@tb3" or a JSON file
  std::string deviceTable;  // the user's entries, merged over the shipped table
  std::string model;        // resnet9..resnet50, unet
  std::string modelFile;    // a TorchScript model instead
  std::string input;        // "3x224x224"; "" = the model's usual input
  int64_t classes = 10;
  std::string amp;          // off, bf16, fp16; "" = off (or the saved profile's)
  std::string profileFile;  // a saved profile instead of a model
  std::string saveProfile;
  std::string calibrate;        // the table key of the device at hand ("" = none)
  std::string calibrateDevice;  // "" = cuda:0 when there is one, else cpu
  int64_t calibrationBatch = 32;
  std::string optimizer = "sgd";
  std::string svg;
  bool json = false;
  bool listDevices = false;
  hddp::WhatIfSettings settings;
};

/// Adds --what-if and its options to hddp-probe's command line (their own group).
void addWhatIfOptions(CLI::App& app, WhatIfOptions& options);

/// Runs --what-if (or --list-devices); returns the exit code.
int runWhatIf(const WhatIfOptions& options);

/// The gradients' shapes of --model, --model-file or --profile (the node probe's
/// --compress prices PowerSGD from them); ConfigError when none is given.
std::vector<std::vector<int64_t>> gradientShapesOf(const WhatIfOptions& options);

}  // namespace hddp_probe
