// hddp-probe: what this node has, how it is attached, and how hddp would split a batch.
//   hddp-probe                       devices, links, eGPUs, bandwidth, versions, advice, split
//   hddp-probe --global-batch 256 --sample-bytes 12288 --json
// Compute speed comes from a short calibration (an MLP training step per device);
// HDDP_EMULATE_SLOWDOWN is applied to it per rank for demos (announced).
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "hddp/hddp.h"
#include "hddp_protocol/job_record.h"
#include "hddp_protocol/launch.h"
#include "node.h"
#include "what_if.h"

namespace {

using json = nlohmann::json;
using hddp_probe::describeDevices;
using hddp_probe::installEmulatorIfAsked;
using hddp_probe::planSplit;
using hddp_probe::printReport;
using hddp_probe::ProbeOptions;
using hddp_probe::ProbePlan;
using hddp_probe::versions;

}  // namespace

int run(int argc, char** argv);

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "hddp-probe: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp-probe: %s\n", e.what());
  }
  return 1;
}

namespace {

// --check-device: 0 when the device is there and runs a kernel, 1 when not, 2 on a bad
// name.
int checkDeviceAnswers(const std::string& name) {
  const std::string emulatorNote = installEmulatorIfAsked(name);
  if (!emulatorNote.empty()) {
    std::fprintf(stderr, "hddp-probe: %s\n", emulatorNote.c_str());
  }
  const int cudaCount =
      at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  c10::Device device(c10::kCPU);
  try {
    if (name.rfind("slot:", 0) == 0) {
      hddp::LaunchInfo info;
      info.slot = std::stoi(name.substr(5));
      info.localRank = info.slot;
      info.localWorldSize = info.slot + 1;
      device = hddp::resolveDevice(info, std::nullopt, hddp::processEnvironment(), cudaCount,
                                   /*allowShared=*/true);
    } else {
      device = hddp::parseDeviceName(name, "--check-device");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp-probe: --check-device %s: %s\n", name.c_str(), e.what());
    return 2;
  }
  if (device.is_cpu()) {
    std::printf("%s: cpu answers\n", name.c_str());
    return 0;
  }
  if (device.type() == c10::DeviceType::PrivateUse1) {
    const int count = static_cast<int>(
        c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->deviceCount());
    if (device.index() >= count) {
      std::printf("%s: %s is not visible (%d %s device(s))\n", name.c_str(), device.str().c_str(),
                  count, c10::get_privateuse1_backend().c_str());
      return 1;
    }
  } else if (device.index() >= cudaCount) {
    std::printf("%s: %s is not visible (%d CUDA device(s))\n", name.c_str(), device.str().c_str(),
                cudaCount);
    return 1;
  }
  try {
    at::Tensor t = at::ones({1024}, at::TensorOptions().device(device));
    const double sum = t.sum().item<double>();  // runs a kernel and waits for it
    std::printf("%s: %s answers (%g)\n", name.c_str(), device.str().c_str(), sum);
    return sum == 1024 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("%s: %s does not answer: %s\n", name.c_str(), device.str().c_str(), e.what());
    return 1;
  }
}

// --job DIR: an elastic job's record, and while it runs the step each slot reached
// (the progress.slot<s> marks in its commit folder).
int showJob(const std::string& dir, bool asJson) {
  hddp::jobrecord::Job job;
  try {
    job = hddp::jobrecord::read(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp-probe: --job: %s\n", e.what());
    return 1;
  }
  json reached = json::object();
  const std::string commits = job.generations.empty() ? "" : job.generations.back().commits;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(commits, ec)) {
    const auto slot = hddp::protocol::progressMarkSlot(entry.path().filename().string());
    if (slot) {
      if (const auto mark = hddp::protocol::readProgressMark(entry.path().string())) {
        reached[std::to_string(*slot)] = mark->step;
      }
    }
  }
  if (asJson) {
    json out = hddp::jobrecord::toJson(job);
    out["folder"] = dir;
    out["step_reached_by_slot"] = reached;
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  std::printf("%s\n", dir.c_str());
  for (const auto& line : hddp::jobrecord::describe(job, hddp::jobrecord::unixNow())) {
    std::printf("%s\n", line.c_str());
  }
  if (!job.ended && !reached.empty()) {
    std::string text;
    for (auto it = reached.begin(); it != reached.end(); ++it) {
      text += (text.empty() ? "" : ", ") + std::string("slot ") + it.key() + " " +
              std::to_string(it.value().get<long long>());
    }
    std::printf("steps reached: %s\n", text.c_str());
  }
  return 0;
}

// --compress on this node: each choice (or the given one) priced over the slowest link
// against the backward of the seed split, PowerSGD's compute timed on every rank's
// device, as the trainers' --compress auto does; the lines go to the advice.
json priceCompression(const ProbePlan& p, const ProbeOptions& o, const hddp_probe::WhatIfOptions& w,
                      std::vector<std::string>& advice) {
  const bool choose = w.settings.compression == "auto";
  const hddp::AmpMode amp = hddp::parseAmpMode(w.amp.empty() ? "off" : w.amp);
  const std::vector<hddp::CompressionSpec> specs =
      choose ? hddp::autoCandidates(amp)
             : std::vector<hddp::CompressionSpec>{
                   hddp::CompressionSpec::parse(w.settings.compression)};
  bool needShapes = false;
  for (const auto& s : specs) {
    needShapes = needShapes || s.kind == hddp::CompressionSpec::Kind::PowerSgd;
  }
  hddp::GradientLayout layout;
  const bool modelGiven = !w.model.empty() || !w.modelFile.empty() || !w.profileFile.empty();
  if (needShapes || (o.paramBytes <= 0 && modelGiven)) {
    layout.shapes = hddp_probe::gradientShapesOf(w);
  } else {
    layout.shapes = {{static_cast<int64_t>(o.paramBytes / 4)}};  // bytes are all that count
  }
  HDDP_CHECK_AS(hddp::ConfigError, layout.bytes() > 0,
                "--compress needs the gradients' size: --param-bytes, or --model / --profile");
  hddp::LinkBudget link;
  link.ranks = static_cast<int>(p.costs.size());
  link.bytesPerSecond = hddp::predictAllreduce(p.costs, layout.bytes()).slowestLinkBytesPerSecond;
  for (size_t r = 0; r < p.costs.size(); ++r) {
    link.backwardSeconds =
        std::max(link.backwardSeconds, hddp::kBackwardShare * p.costs[r].secondsPerSample *
                                           static_cast<double>(p.plan.local[r]));
  }
  std::vector<hddp::CompressionCost> priced;
  for (const auto& spec : specs) {
    double compute = 0.0;
    if (spec.kind == hddp::CompressionSpec::Kind::PowerSgd && link.ranks > 1) {
      hddp::PowerSgdOptions po;
      po.rank = spec.rank;
      for (const auto& d : p.rankDevices) {
        compute = std::max(compute, hddp::timePowerSgdCompute(layout.shapes, po, d));
      }
    }
    priced.push_back(
        hddp::priceCompression(hddp::compressionTraffic(spec, layout), layout, link, compute));
  }
  const hddp::CompressionDecision d = hddp::chooseCompression(priced, link);
  json candidates = json::array();
  for (const auto& c : d.candidates) {
    candidates.push_back({{"choice", c.spec.name()},
                          {"wire_bytes", c.wireBytes},
                          {"allreduces", c.messages},
                          {"allreduce_s", c.allreduceSeconds},
                          {"compute_s", c.computeSeconds},
                          {"exposed_s", c.exposedSeconds},
                          {"hidden", c.hidden}});
    advice.push_back("--compress " + c.describe());
  }
  if (choose) {
    advice.push_back("--compress auto would choose " + d.why);
  }
  return {{"chosen", d.chosen.spec.name()},
          {"why", choose ? json(d.why) : json(nullptr)},
          {"backward_s", link.backwardSeconds},
          {"candidates", candidates}};
}

}  // namespace

int run(int argc, char** argv) {
  ProbeOptions o;
  CLI::App app{
      "hddp-probe: devices, links, eGPUs, bandwidth, versions, advice, and the batch split hddp "
      "would use"};
  app.add_option("--global-batch", o.globalBatch, "Global batch to split")->capture_default_str();
  app.add_option("--sample-bytes", o.sampleBytes, "Input bytes per sample moved to the device")
      ->capture_default_str();
  app.add_option("--sample-mib", o.sampleMiB,
                 "Device memory per sample (MiB: activations and workspace) for the memory "
                 "cap; 0 = no cap")
      ->check(hddp::cli::nonNegative());
  app.add_option("--fixed-mib", o.fixedMiB,
                 "Device memory a step holds whatever the batch (MiB: parameters, gradients, "
                 "optimizer state), for the memory cap")
      ->check(hddp::cli::nonNegative());
  app.add_option("--memory-headroom", o.headroom,
                 "Fraction of each device's memory kept free in the memory cap (the Trainer's "
                 "default)")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  app.add_option("--param-bytes", o.paramBytes,
                 "Gradient bytes per step (the model's parameters), for the allreduce term")
      ->capture_default_str();
  app.add_option("--cpu-ranks", o.cpuRanks, "Without CUDA: CPU ranks to plan for")
      ->capture_default_str();
  app.add_option("--sysfs", o.sysfs, "sysfs root (for fixtures)")->capture_default_str();
  app.add_flag("--json", o.asJson, "Machine-readable output");
  app.add_flag("--no-bandwidth", o.skipBandwidth, "Skip the bandwidth measurement");
  std::string checkDevice;
  app.add_option("--check-device", checkDevice,
                 "Only check that a device answers (exit 0) or not (exit 1): cpu, cuda:N, or "
                 "slot:N for the device a rank of hddp-run's slot N takes (HDDP_DEVICE, else "
                 "cuda:N with CUDA, else cpu); hddp-run's rejoin check");
  std::string jobDir;
  app.add_option("--job", jobDir,
                 "Only show an elastic job (hddp-run --nproc-per-node MIN:MAX): its generations, "
                 "the slots that left and came back, steps trained again, re-forming times, the "
                 "newest commit; DIR is the folder hddp-run names (or its --job-dir)");
  hddp_probe::WhatIfOptions w;
  hddp_probe::addWhatIfOptions(app, w);
  CLI11_PARSE(app, argc, argv);
  hddp::log::setLevel(hddp::log::Level::Warn);
  if (!w.spec.empty() || w.listDevices) {
    w.settings.globalBatch = o.globalBatch;
    w.settings.memoryHeadroom = o.headroom;
    w.json = o.asJson;
    return hddp_probe::runWhatIf(w);
  }
  if (!checkDevice.empty()) {
    return checkDeviceAnswers(checkDevice);
  }
  if (!jobDir.empty()) {
    return showJob(jobDir, o.asJson);
  }

  const std::string emulatorNote = installEmulatorIfAsked();
  const bool hasCuda = at::detail::getCUDAHooks().hasCUDA();
  json out;
  out["versions"] = versions(hasCuda);
  hddp::TopologyOptions topo;
  topo.sysfsRoot = o.sysfs;
  const auto devices = hddp::probeDevices(topo);
  std::vector<std::string> advice;
  if (!emulatorNote.empty()) {
    advice.push_back(emulatorNote);
  }
  const json devs = describeDevices(devices, o, hasCuda, advice);
  out["devices"] = devs;
  const auto emulated = std::count_if(devices.begin(), devices.end(), [](const auto& d) {
    return d.device.type() == c10::DeviceType::PrivateUse1;
  });
  if (!hasCuda) {
    advice.push_back(
        "no CUDA device is visible: check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES, and that "
        "this LibTorch is a CUDA build; planning for " +
        std::string(emulated > 0 ? "the " + c10::get_privateuse1_backend() + " devices"
                                 : "CPU ranks"));
  }
  if (emulated > 0 && c10::get_privateuse1_backend() == "emu") {
    advice.push_back(
        "hddp::emu is on (HDDP_EMU_DEVICES / HDDP_DEVICE): " + std::to_string(emulated) +
        " emulated device(s) computing on this CPU, at its speed times any "
        "HDDP_EMU_SLOWDOWN factor; for tests and demos, not a GPU");
  }
  const ProbePlan p = planSplit(devices, devs, o);
  out["plan"] = {{"global_batch", o.globalBatch},
                 {"ranks", p.ranks},
                 {"predicted_step_s", p.plan.predictedStepSeconds},
                 {"equal_split_predicted_step_s", hddp::predictedSeconds(p.costs, p.equal.local)},
                 {"slowest_link_GBps", p.slowestLinkBytesPerSecond / 1e9},
                 {"allreduce_s", p.allreduceSeconds}};
  if (w.settings.compression != "none") {
    out["plan"]["compression"] = priceCompression(p, o, w, advice);
  }
  json env = json::array();
  for (const auto& s : hddp::env::describe()) {
    env.push_back({{"name", s.name}, {"value", s.value}, {"set_by", s.setBy}});
  }
  out["environment"] = env;
  out["advice"] = advice;
  if (o.asJson) {
    std::cout << out.dump(1) << "\n";
  } else {
    printReport(out, devices, devs, p, o, advice);
  }
  return 0;
}
