#include "hddp/data/dataset.h"

#include <ATen/ATen.h>

#include "hddp/core/error.h"

namespace hddp {

std::string Dataset::describe() const {
  return "dataset of " + std::to_string(size()) + " samples";
}

namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

at::Tensor stackInto(const std::vector<at::Tensor>& parts, bool pinned, const char* what) {
  const at::Tensor& first = parts.front();
  std::vector<int64_t> shape{static_cast<int64_t>(parts.size())};
  for (auto d : first.sizes()) {
    shape.push_back(d);
  }
  auto options = first.options();
  if (pinned) {
    options = options.pinned_memory(true);
  }
  at::Tensor out = at::empty(shape, options);
  for (size_t i = 0; i < parts.size(); ++i) {
    HDDP_CHECK_AS(DataError, parts[i].sizes() == first.sizes() && parts[i].dtype() == first.dtype(),
                  "cannot batch samples of different shapes: ", what, " ", i, " is ",
                  parts[i].sizes(), " ", parts[i].dtype(), ", the first is ", first.sizes(), " ",
                  first.dtype(),
                  ". Resize the data to one shape (e.g. the trainers' --image-size).");
    out.select(0, static_cast<int64_t>(i)).copy_(parts[i]);
  }
  return out;
}

}  // namespace

uint64_t sampleSeed(uint64_t seed, int64_t epoch, int64_t index) {
  return splitmix(splitmix(splitmix(seed) ^ static_cast<uint64_t>(epoch)) ^
                  static_cast<uint64_t>(index));
}

Example collate(const std::vector<Example>& examples, bool pinned) {
  HDDP_CHECK(!examples.empty(), "collate() needs at least one example");
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> targets;
  inputs.reserve(examples.size());
  targets.reserve(examples.size());
  for (const auto& e : examples) {
    HDDP_CHECK_AS(DataError, e.input.defined() && e.target.defined(),
                  "a dataset returned an example without input or target");
    inputs.push_back(e.input);
    targets.push_back(e.target);
  }
  return Example{stackInto(inputs, pinned, "input"), stackInto(targets, pinned, "target")};
}

}  // namespace hddp
