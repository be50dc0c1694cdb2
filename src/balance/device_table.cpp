// The what-if device table (hddp/balance/device_table.h): parsing with errors that name
// the file, entry and field; lookups that suggest the closest key; mixes.
#include "hddp/balance/device_table.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "hddp/core/env.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

using json = nlohmann::json;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// Edit distance, for "did you mean".
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) {
    row[j] = j;
  }
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

template <typename Map>
std::string known(const Map& entries, const std::string& wanted) {
  std::string list;
  std::string closest;
  size_t best = static_cast<size_t>(-1);
  for (const auto& [key, value] : entries) {
    list += (list.empty() ? "" : ", ") + key;
    const size_t d = distance(lower(wanted), key);
    if (d < best) {
      best = d;
      closest = key;
    }
  }
  std::string text = "known: " + list;
  if (!closest.empty() && best <= std::max<size_t>(2, wanted.size() / 3)) {
    text = "did you mean '" + closest + "'? " + text;
  }
  return text;
}

double number(const json& entry, const std::string& where, const char* field, bool zeroAllowed) {
  HDDP_CHECK_AS(ConfigError, entry.contains(field), where, ": missing field '", field, "'");
  const json& v = entry.at(field);
  HDDP_CHECK_AS(ConfigError, v.is_number(), where, ": '", field, "' must be a number, not ",
                v.dump());
  const double x = v.get<double>();
  HDDP_CHECK_AS(ConfigError, std::isfinite(x) && (zeroAllowed ? x >= 0 : x > 0), where, ": '",
                field, "' must be ", zeroAllowed ? "0 (none) or positive" : "positive", ", not ",
                v.dump());
  return x;
}

std::string text(const json& entry, const std::string& where, const char* field) {
  HDDP_CHECK_AS(ConfigError,
                entry.contains(field) && entry.at(field).is_string() &&
                    !entry.at(field).get<std::string>().empty(),
                where, ": '", field, "' must be a non-empty string",
                std::string(field) == "source"
                    ? " (where the figures come from: a datasheet, a whitepaper, a measurement)"
                    : "");
  return entry.at(field).get<std::string>();
}

void onlyFields(const json& entry, const std::string& where, const std::set<std::string>& fields) {
  HDDP_CHECK_AS(ConfigError, entry.is_object(), where, " must be an object, not ", entry.dump());
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    if (!fields.count(it.key())) {
      std::string list;
      for (const auto& f : fields) {
        list += (list.empty() ? "" : ", ") + f;
      }
      HDDP_CHECK_AS(ConfigError, false, where, ": unknown field '", it.key(), "' (fields: ", list,
                    ")");
    }
  }
}

// A section of the table: an object of entries by key.
void checkSection(const json& root, const char* name, const std::string& origin) {
  HDDP_CHECK_AS(ConfigError, root[name].is_object(), origin, ": \"", name,
                "\" must be an object of entries by key");
}

void checkKey(const std::string& key, const std::string& where) {
  HDDP_CHECK_AS(ConfigError,
                key == lower(key) && !key.empty() && key.find_first_of("@, ") == std::string::npos,
                where, ": a key is lower case without '@', ',' or spaces");
}

}  // namespace

DeviceTable DeviceTable::parse(const std::string& textIn, const std::string& origin) {
  json root;
  try {
    root = json::parse(textIn);
  } catch (const json::exception& e) {  // a syntax error, or a number beyond a double
    HDDP_CHECK_AS(ConfigError, false, origin, " is not valid JSON: ", e.what());
  }
  HDDP_CHECK_AS(ConfigError, root.is_object(), origin,
                " must be a JSON object with \"devices\" and/or \"links\"");
  onlyFields(root, origin, {"devices", "links", "published", "comment"});
  DeviceTable table;
  if (root.contains("devices")) {
    checkSection(root, "devices", origin);
    for (auto it = root["devices"].begin(); it != root["devices"].end(); ++it) {
      const std::string where = origin + ": device '" + it.key() + "'";
      checkKey(it.key(), where);
      onlyFields(it.value(), where,
                 {"name", "fp32_tflops", "fp16_tflops", "bf16_tflops", "memory_gib", "memory_GBps",
                  "source", "comment"});
      DeviceSpec d;
      d.key = it.key();
      d.name = text(it.value(), where, "name");
      d.fp32Tflops = number(it.value(), where, "fp32_tflops", false);
      d.fp16Tflops = number(it.value(), where, "fp16_tflops", true);
      d.bf16Tflops = number(it.value(), where, "bf16_tflops", true);
      d.memoryGiB = number(it.value(), where, "memory_gib", false);
      d.memoryGBps = number(it.value(), where, "memory_GBps", false);
      d.source = text(it.value(), where, "source");
      table.devices_[d.key] = d;
    }
  }
  if (root.contains("links")) {
    checkSection(root, "links", origin);
    for (auto it = root["links"].begin(); it != root["links"].end(); ++it) {
      const std::string where = origin + ": link '" + it.key() + "'";
      checkKey(it.key(), where);
      onlyFields(it.value(), where, {"name", "GBps", "source", "comment"});
      LinkSpec l;
      l.key = it.key();
      l.name = text(it.value(), where, "name");
      l.GBps = number(it.value(), where, "GBps", false);
      l.source = text(it.value(), where, "source");
      table.links_[l.key] = l;
    }
  }
  if (root.contains("published")) {
    HDDP_CHECK_AS(ConfigError, root["published"].is_array(), origin,
                  ": \"published\" must be an array of figures");
    size_t index = 0;
    for (const json& f : root["published"]) {
      const std::string where = origin + ": published figure " + std::to_string(index++);
      onlyFields(
          f, where,
          {"device", "model", "input", "amp", "batch", "samples_per_second", "source", "comment"});
      PublishedFigure p;
      p.device = text(f, where, "device");
      p.model = text(f, where, "model");
      p.input = text(f, where, "input");
      p.amp = text(f, where, "amp");
      HDDP_CHECK_AS(ConfigError, p.amp == "off" || p.amp == "fp16" || p.amp == "bf16", where,
                    ": 'amp' is off, fp16 or bf16, not '", p.amp, "'");
      p.batch = static_cast<int64_t>(number(f, where, "batch", false));
      p.samplesPerSecond = number(f, where, "samples_per_second", false);
      p.source = text(f, where, "source");
      table.published_.push_back(p);
    }
  }
  return table;
}

DeviceTable DeviceTable::load(const std::string& path) {
  std::ifstream in(path);
  HDDP_CHECK_AS(ConfigError, in.good(), "cannot read the device table ", path);
  std::stringstream s;
  s << in.rdbuf();
  return parse(s.str(), path);
}

DeviceTable DeviceTable::builtIn() {
  const std::string given = env::getString("HDDP_DEVICE_TABLE");
  if (!given.empty()) {
    return load(given);
  }
  std::vector<std::string> candidates;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&DeviceTable::builtIn), &info) && info.dli_fname) {
    const auto lib = std::filesystem::path(info.dli_fname).parent_path();
    candidates.push_back((lib.parent_path() / "share" / "hddp" / "devices.json").string());
  }
  candidates.push_back(HDDP_SOURCE_DEVICE_TABLE);
  for (const auto& path : candidates) {
    std::error_code ec;
    if (std::filesystem::exists(path, ec)) {
      return load(path);
    }
  }
  std::string list;
  for (const auto& path : candidates) {
    list += (list.empty() ? "" : ", ") + path;
  }
  HDDP_CHECK_AS(ConfigError, false, "hddp's device table is not where it should be (", list,
                "): set HDDP_DEVICE_TABLE to a devices.json");
  return {};
}

void DeviceTable::merge(const DeviceTable& other) {
  for (const auto& [key, d] : other.devices_) {
    devices_[key] = d;
  }
  for (const auto& [key, l] : other.links_) {
    links_[key] = l;
  }
  published_.insert(published_.end(), other.published_.begin(), other.published_.end());
}

namespace {

template <typename Map>
const typename Map::mapped_type& lookUp(const Map& entries, const std::string& key,
                                        const char* what, const std::string& context) {
  const auto it = entries.find(lower(key));
  HDDP_CHECK_AS(ConfigError, it != entries.end(), context, "no ", what, " '", key,
                "' in the device table (", known(entries, key),
                "); add it with a table of your own");
  return it->second;
}

}  // namespace

const DeviceSpec& DeviceTable::device(const std::string& key) const {
  return lookUp(devices_, key, "device", "");
}

const LinkSpec& DeviceTable::link(const std::string& key) const {
  return lookUp(links_, key, "link", "");
}

std::vector<MixEntry> DeviceTable::parseMix(const std::string& spec,
                                            const std::string& defaultLink) const {
  std::vector<MixEntry> mix;
  std::stringstream items(spec);
  std::string item;
  while (std::getline(items, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    HDDP_CHECK_AS(ConfigError, !item.empty(), "mix '", spec,
                  "': an empty item; give DEVICE[@LINK] items separated by commas, e.g. "
                  "rtx4090@pcie4x16,rtx3060@tb3");
    const auto at = item.find('@');
    HDDP_CHECK_AS(ConfigError,
                  at != 0 && item.find('@', at + 1) == std::string::npos &&
                      (at == std::string::npos || at + 1 < item.size()),
                  "mix '", spec, "': item '", item, "' is not DEVICE[@LINK]");
    const std::string context = "mix '" + spec + "', item '" + item + "': ";
    MixEntry e;
    e.device = lookUp(devices_, item.substr(0, at), "device", context);
    e.link = lookUp(links_, at == std::string::npos ? defaultLink : item.substr(at + 1), "link",
                    context);
    mix.push_back(e);
  }
  HDDP_CHECK_AS(ConfigError, !mix.empty(), "mix '", spec, "' names no device");
  return mix;
}

}  // namespace hddp
