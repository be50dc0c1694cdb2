// ModelProfile as JSON (hddp/balance/what_if.h): what hddp-probe --profile writes and
// --what-if --profile reads.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hddp/balance/what_if.h"
#include "hddp/core/error.h"

namespace hddp {

using json = nlohmann::json;

std::string ModelProfile::toJson() const {
  json j = {{"model", model},
            {"forward_flops_per_sample", forwardFlopsPerSample},
            {"train_flops_per_sample", trainFlopsPerSample},
            {"activation_bytes_per_sample", activationBytesPerSample},
            {"parameter_bytes", parameterBytes},
            {"input_bytes_per_sample", inputBytesPerSample},
            {"amp", ampModeName(amp)}};
  if (!gradientShapes.empty()) {
    j["gradient_shapes"] = gradientShapes;
  }
  if (!calibratedOn.empty()) {
    j["calibration"] = {{"device", calibratedOn},
                        {"seconds_per_sample", calibratedSecondsPerSample},
                        {"fixed_seconds", calibratedFixedSeconds}};
  }
  return j.dump(1) + "\n";
}

ModelProfile ModelProfile::fromJson(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    HDDP_THROW(ConfigError, origin, ": not a model profile (", e.what(), ")");
  }
  HDDP_CHECK_AS(ConfigError, j.is_object(), origin, ": a model profile is a JSON object");
  auto number = [&](const json& o, const char* key, const std::string& where) {
    HDDP_CHECK_AS(ConfigError, o.contains(key) && o[key].is_number() && o[key].get<double>() >= 0,
                  origin, ": ", where, key, " must be a number >= 0");
    return o[key].get<double>();
  };
  ModelProfile p;
  HDDP_CHECK_AS(ConfigError, j.contains("model") && j["model"].is_string(), origin,
                ": \"model\" must name the model");
  p.model = j["model"].get<std::string>();
  p.forwardFlopsPerSample = number(j, "forward_flops_per_sample", "");
  p.trainFlopsPerSample = number(j, "train_flops_per_sample", "");
  p.activationBytesPerSample = number(j, "activation_bytes_per_sample", "");
  p.parameterBytes = number(j, "parameter_bytes", "");
  p.inputBytesPerSample = number(j, "input_bytes_per_sample", "");
  HDDP_CHECK_AS(ConfigError, j.contains("amp") && j["amp"].is_string(), origin,
                ": \"amp\" must be off, bf16 or fp16");
  try {
    p.amp = parseAmpMode(j["amp"].get<std::string>());
  } catch (const ConfigError& e) {
    HDDP_THROW(ConfigError, origin, ": ", e.what());
  }
  if (j.contains("gradient_shapes")) {
    const json& g = j["gradient_shapes"];
    bool valid = g.is_array();
    for (size_t k = 0; valid && k < g.size(); ++k) {
      valid = g[k].is_array();
      for (size_t d = 0; valid && d < g[k].size(); ++d) {
        valid = g[k][d].is_number_integer() && g[k][d].get<int64_t>() >= 0;
      }
      if (valid) {
        p.gradientShapes.push_back(g[k].get<std::vector<int64_t>>());
      }
    }
    HDDP_CHECK_AS(ConfigError, valid, origin,
                  ": gradient_shapes must be a list of shapes, each a list of sizes >= 0");
  }
  if (j.contains("calibration")) {
    const json& c = j["calibration"];
    HDDP_CHECK_AS(ConfigError, c.is_object() && c.contains("device") && c["device"].is_string(),
                  origin, ": calibration.device must name the table's device it ran on");
    p.calibratedOn = c["device"].get<std::string>();
    p.calibratedSecondsPerSample = number(c, "seconds_per_sample", "calibration.");
    p.calibratedFixedSeconds = number(c, "fixed_seconds", "calibration.");
  }
  return p;
}

}  // namespace hddp
