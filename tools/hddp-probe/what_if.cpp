// hddp-probe --what-if (what_if.h): its options, the mix, the model's profile (counted from
// one of the example models, a TorchScript file, or a saved profile; optionally calibrated
// on the device at hand) and the prediction. Its table, JSON and SVG: what_if_report.cpp.
#include "what_if.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_checks.h"
#include "hddp/hddp.h"
#include "hddp/train/model_profile.h"
#include "resnet.h"
#include "unet.h"
#include "what_if_report.h"

namespace hddp_probe {
namespace {

using json = nlohmann::json;

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  HDDP_CHECK_AS(hddp::ConfigError, static_cast<bool>(in), "cannot read ", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<int64_t> parseShape(const std::string& text) {
  std::vector<int64_t> shape;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, 'x')) {
    char* end = nullptr;
    const long long v = std::strtoll(part.c_str(), &end, 10);
    HDDP_CHECK_AS(hddp::ConfigError, !part.empty() && *end == '\0' && v > 0, "--input ", text,
                  ": give the sample's sizes as positive integers joined by x, e.g. 3x224x224");
    shape.push_back(v);
  }
  HDDP_CHECK_AS(hddp::ConfigError, !shape.empty(), "--input is empty: e.g. 3x224x224");
  return shape;
}

// The mix and the table: SPEC is a mix, or a JSON file {"mix": [...], "devices": {...},
// "links": {...}} whose entries join the table.
std::vector<hddp::MixEntry> loadMix(const WhatIfOptions& o, hddp::DeviceTable& table) {
  if (!o.deviceTable.empty()) {
    table.merge(hddp::DeviceTable::load(o.deviceTable));
  }
  if (!std::filesystem::is_regular_file(o.spec)) {
    return table.parseMix(o.spec);
  }
  json j;
  try {
    j = json::parse(readFile(o.spec));
  } catch (const json::exception& e) {
    HDDP_THROW(hddp::ConfigError, o.spec, " is not valid JSON: ", e.what());
  }
  HDDP_CHECK_AS(hddp::ConfigError, j.is_object() && j.contains("mix") && j["mix"].is_array(),
                o.spec, ": a what-if file holds \"mix\": [\"device@link\", ...]");
  std::string spec;
  for (const auto& item : j["mix"]) {
    HDDP_CHECK_AS(hddp::ConfigError, item.is_string(), o.spec,
                  ": each mix item is a string \"device@link\", not ", item.dump());
    spec += (spec.empty() ? "" : ",") + item.get<std::string>();
  }
  j.erase("mix");
  if (!j.empty()) {
    table.merge(hddp::DeviceTable::parse(j.dump(), o.spec));
  }
  return table.parseMix(spec);
}

c10::Device calibrationDevice(const WhatIfOptions& o) {
  if (!o.calibrateDevice.empty()) {
    return hddp::parseDeviceName(o.calibrateDevice, "--calibrate-device");
  }
  return torch::cuda::is_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
}

// The profile: saved, or counted from the model (and calibrated when asked).
hddp::ModelProfile loadProfile(const WhatIfOptions& o, const hddp::DeviceTable& table) {
  if (!o.profileFile.empty()) {
    return hddp::ModelProfile::fromJson(readFile(o.profileFile), o.profileFile);
  }
  HDDP_CHECK_AS(hddp::ConfigError, !o.model.empty() || !o.modelFile.empty(),
                "--what-if needs a model: --model (resnet9, resnet20, resnet32, resnet56, "
                "resnet18, resnet34, resnet50, unet), --model-file (TorchScript) or --profile");
  hddp::ProfileOptions p;
  p.amp = hddp::parseAmpMode(o.amp.empty() ? "off" : o.amp);
  p.calibrationBatch = o.calibrationBatch;
  if (!o.calibrate.empty()) {
    table.device(o.calibrate);  // a key the table knows, or a clear error now
    p.calibrateOn = o.calibrate;
    p.device = calibrationDevice(o);
  }
  if (!o.modelFile.empty()) {
    HDDP_CHECK_AS(hddp::ConfigError, !o.input.empty(),
                  "--model-file needs --input, the shape of one sample (e.g. 3x224x224)");
    p.sampleShape = parseShape(o.input);
    torch::jit::Module module = torch::jit::load(o.modelFile);
    module.train();
    std::vector<at::Tensor> parameters;
    for (const auto& t : module.parameters()) {
      parameters.push_back(t);
    }
    p.model = std::filesystem::path(o.modelFile).filename().string() + " " + o.input;
    p.moveTo = [&](const c10::Device& d) { module.to(d); };
    return hddp::profileModel([&](const at::Tensor& x) { return module.forward({x}).toTensor(); },
                              parameters, p);
  }
  if (o.model == "unet") {
    p.sampleShape = parseShape(o.input.empty() ? "1x128x128" : o.input);
    HDDP_CHECK_AS(hddp::ConfigError, p.sampleShape.size() == 3,
                  "--input for unet is C x H x W, not ", o.input);
    hddp::models::UNetOptions mo;
    mo.inChannels = p.sampleShape[0];
    mo.numClasses = o.classes;
    hddp::models::UNet net(mo);
    p.model = "unet " + (o.input.empty() ? std::string("1x128x128") : o.input);
    p.moveTo = [&](const c10::Device& d) { net->to(d); };
    return hddp::profileModel([&](const at::Tensor& x) { return net->forward(x); },
                              net->parameters(), p);
  }
  HDDP_CHECK_AS(hddp::ConfigError, hddp::models::isResNetArch(o.model), "--model ", o.model,
                " is not one of resnet9, resnet20, resnet32, resnet56, resnet18, resnet34, "
                "resnet50, unet (or give --model-file, a TorchScript model)");
  const bool imagenet = o.model == "resnet18" || o.model == "resnet34" || o.model == "resnet50";
  const std::string input = o.input.empty() ? (imagenet ? "3x224x224" : "3x32x32") : o.input;
  p.sampleShape = parseShape(input);
  HDDP_CHECK_AS(hddp::ConfigError,
                p.sampleShape.size() == 3 && p.sampleShape[1] == p.sampleShape[2],
                "--input for a ResNet is C x S x S (square images), not ", input);
  hddp::models::ResNetOptions mo;
  mo.arch = o.model;
  mo.inChannels = p.sampleShape[0];
  mo.imageSize = p.sampleShape[1];
  mo.numClasses = o.classes;
  hddp::models::ResNet net(mo);
  p.model = o.model + " " + input;
  p.moveTo = [&](const c10::Device& d) { net->to(d); };
  return hddp::profileModel([&](const at::Tensor& x) { return net->forward(x); }, net->parameters(),
                            p);
}

}  // namespace

// --what-if and its options (what_if.h), in their own group of --help.
void addWhatIfOptions(CLI::App& app, WhatIfOptions& w) {
  const std::string g = "What-if (predict a mix of cards and links; docs/egpu.md)";
  app.add_option("--what-if", w.spec,
                 "Predict a mix instead of probing: device@link,... (e.g. "
                 "rtx4090@pcie4x16,rtx3060@tb3; no @link = pcie4x16) or a JSON file with "
                 "\"mix\" (and \"devices\"/\"links\" of your own)")
      ->group(g);
  app.add_flag("--list-devices", w.listDevices, "List the device table's cards and links")
      ->group(g);
  app.add_option("--device-table", w.deviceTable,
                 "Your own device/link entries (devices.json's format), merged over the table")
      ->group(g);
  app.add_option("--model", w.model,
                 "resnet9, resnet20, resnet32, resnet56, resnet18, resnet34, resnet50 or unet: "
                 "its FLOPs, activation memory and parameters are counted from the model")
      ->group(g);
  app.add_option("--model-file", w.modelFile,
                 "Your own model, saved as TorchScript (needs --input)")
      ->check(CLI::ExistingFile)
      ->group(g);
  app.add_option("--input", w.input,
                 "One sample's shape, CxHxW (default 3x224x224 for resnet18/34/50, 3x32x32 for "
                 "the other ResNets, 1x128x128 for unet)")
      ->group(g);
  app.add_option("--classes", w.classes, "Output classes of --model")
      ->check(hddp::cli::positive())
      ->capture_default_str()
      ->group(g);
  app.add_option("--amp", w.amp, "Precision: off, bf16 or fp16 (default off)")->group(g);
  app.add_option("--profile", w.profileFile,
                 "A saved model profile (--save-profile) instead of --model")
      ->check(CLI::ExistingFile)
      ->group(g);
  app.add_option("--save-profile", w.saveProfile, "Write the model's profile to this file")
      ->group(g);
  app.add_option("--calibrate", w.calibrate,
                 "Time the model on the device at hand, which is the table's entry KEY, and scale "
                 "to the others by peak ratios (instead of --efficiency)")
      ->group(g);
  app.add_option("--calibrate-device", w.calibrateDevice,
                 "The device --calibrate times (default cuda:0, else cpu)")
      ->group(g);
  app.add_option("--calibration-batch", w.calibrationBatch,
                 "Batch --calibrate times (and half of it)")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str()
      ->group(g);
  app.add_option("--efficiency", w.settings.efficiency,
                 "Without a calibration: the share of each card's peak the products reach "
                 "(default: fitted to the table's published figures)")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str()
      ->group(g);
  app.add_option("--memory-traffic", w.settings.memoryTraffic,
                 "Without a calibration: device-memory bytes a step moves per byte of saved "
                 "activations (default: fitted with --efficiency; 0 = products only)")
      ->check(hddp::cli::nonNegative())
      ->capture_default_str()
      ->group(g);
  app.add_option("--optimizer", w.optimizer,
                 "sgd (momentum) or adam: the optimizer's state in memory")
      ->capture_default_str()
      ->group(g);
  app.add_flag("!--no-prefetch", w.settings.prefetch,
               "Input copies do not overlap compute (a loader without prefetch)")
      ->group(g);
  app.add_option("--allreduce-gbps", w.settings.allreduceGBps,
                 "The gradient ring's bandwidth when it has its own path (NVLink; ranks of one "
                 "host over loopback), GB/s; default: the slowest device link")
      ->check(hddp::cli::nonNegative())
      ->group(g);
  app.add_option("--compress", w.settings.compression,
                 "Gradient compression to price: none, fp16, bf16, powersgd[:RANK], or auto "
                 "(each priced, and the one the trainers' --compress auto would choose)")
      ->check([](const std::string& v) -> std::string {
        if (v == "auto") {
          return {};
        }
        try {
          hddp::CompressionSpec::parse(v);
          return {};
        } catch (const hddp::ConfigError&) {
          return "'" + v +
                 "' is not none, fp16, bf16, powersgd, powersgd:RANK (RANK a whole "
                 "number from 1) or auto";
        }
      })
      ->capture_default_str()
      ->group(g);
  app.add_option("--zero", w.settings.zero,
                 "ZeRO to plan for, as the trainers' --zero: 0 plain data parallelism, 1 the "
                 "optimizer state sharded across the cards, 2 the gradients too")
      ->check(CLI::Range(0, 2))
      ->capture_default_str()
      ->group(g);
  app.add_option("--shard-by", w.settings.shardBy,
                 "With --zero 1|2, how the shards are sized, as the trainers' --shard-by: memory "
                 "(each card's free memory after the model), equal, or R0:R1:... (one ratio per "
                 "card of the mix)")
      ->capture_default_str()
      ->group(g);
  app.add_option("--svg", w.svg, "Also draw each device's time per step as an SVG chart")->group(g);
}

std::vector<std::vector<int64_t>> gradientShapesOf(const WhatIfOptions& o) {
  HDDP_CHECK_AS(hddp::ConfigError,
                !o.model.empty() || !o.modelFile.empty() || !o.profileFile.empty(),
                "--compress powersgd or auto prices PowerSGD from the gradients' shapes: name "
                "the model with --model (resnet9 ... resnet50, unet), --model-file or --profile");
  const auto shapes = loadProfile(o, hddp::DeviceTable::builtIn()).gradientShapes;
  HDDP_CHECK_AS(hddp::ConfigError, !shapes.empty(), "the profile ", o.profileFile,
                " has no gradient shapes (saved before they were recorded): profile the model "
                "again with --model and --save-profile");
  return shapes;
}

int runWhatIf(const WhatIfOptions& o) {
  hddp::DeviceTable table = hddp::DeviceTable::builtIn();
  if (o.listDevices) {
    if (!o.deviceTable.empty()) {
      table.merge(hddp::DeviceTable::load(o.deviceTable));
    }
    listDevices(table);
    return 0;
  }
  const auto mix = loadMix(o, table);
  WhatIfOptions options = o;
  HDDP_CHECK_AS(hddp::ConfigError, o.optimizer == "sgd" || o.optimizer == "adam",
                "--optimizer is sgd (momentum: 1 copy of the weights) or adam (2), not ",
                o.optimizer);
  options.settings.optimizerStateCopies = o.optimizer == "adam" ? 2.0 : 1.0;
  HDDP_CHECK_AS(hddp::ConfigError, o.profileFile.empty() || o.calibrate.empty(),
                "--calibrate measures a model (--model or --model-file), not a saved --profile");
  hddp::ModelProfile profile = loadProfile(o, table);
  HDDP_CHECK_AS(hddp::ConfigError, o.amp.empty() || hddp::parseAmpMode(o.amp) == profile.amp,
                o.profileFile, " was measured with --amp ", hddp::ampModeName(profile.amp),
                ": activations under --amp ", o.amp, " need a new profile (--model ... --amp ",
                o.amp, " --save-profile FILE)");
  if (!o.saveProfile.empty()) {
    std::ofstream(o.saveProfile) << profile.toJson();
  }
  const auto result = hddp::predictMix(mix, profile, options.settings, table);
  if (!o.svg.empty()) {
    std::ofstream out(o.svg);
    out << svgChart(result, profile);
    HDDP_CHECK_AS(hddp::ConfigError, static_cast<bool>(out), "cannot write ", o.svg);
  }
  if (o.json) {
    std::cout << toJson(result, profile, options).dump(1) << "\n";
  } else {
    printTable(result, profile, options);
  }
  return 0;
}

}  // namespace hddp_probe
