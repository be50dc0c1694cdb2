// The trainers' data sets and evaluation (example_common.h): seeded random subsets
// (--limit-train, --limit-test, a held-out validation split) and sharded evaluation with
// one allreduce, on the epochs --eval-every selects.
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <optional>
#include <random>

#include "example_common.h"
#include "hddp/balance/batch_plan.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/autocast.h"
#include "hddp/core/error.h"

namespace hddp {
namespace examples {

namespace {

class IndexedSubset : public Dataset {
 public:
  IndexedSubset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices)
      : base_(std::move(base)), indices_(std::move(indices)) {}
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Example get(int64_t index, SampleRng& rng) const override {
    return base_->get(indices_.at(static_cast<size_t>(index)), rng);
  }
  std::string describe() const override {
    return c10::str(base_->describe(), " (", indices_.size(), " of them)");
  }

 private:
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
};

}  // namespace

std::shared_ptr<const Dataset> randomSubset(std::shared_ptr<const Dataset> base, int64_t count,
                                            uint64_t seed, int64_t skip) {
  const int64_t n = base->size();
  HDDP_CHECK_AS(ConfigError, count >= 0 && skip >= 0 && skip + count <= n, "cannot take ", count,
                " samples after skipping ", skip, " from ", base->describe(), ": it has only ", n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed ^ 0x5eedull);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int64_t> picked(order.begin() + skip, order.begin() + skip + count);
  std::sort(picked.begin(), picked.end());
  return std::make_shared<IndexedSubset>(std::move(base), std::move(picked));
}

std::pair<std::shared_ptr<const Dataset>, std::shared_ptr<const Dataset>> holdOut(
    std::shared_ptr<const Dataset> train, std::shared_ptr<const Dataset> evalView, double fraction,
    uint64_t seed) {
  const int64_t n = train->size();
  HDDP_CHECK_AS(ConfigError, evalView->size() == n, "holdOut: the evaluation view has ",
                evalView->size(), " samples, the training set ", n);
  const auto held = static_cast<int64_t>(static_cast<double>(n) * fraction);
  HDDP_CHECK_AS(ConfigError, held >= 1 && held < n, "--val-fraction ", fraction, " of ", n,
                " images leaves no training or no validation images; give --test-data DIR or "
                "another fraction");
  auto test = randomSubset(std::move(evalView), held, seed, 0);
  return {randomSubset(std::move(train), n - held, seed, held), std::move(test)};
}

void applyLimits(const CommonFlags& flags, std::shared_ptr<const Dataset>& train,
                 std::shared_ptr<const Dataset>& test) {
  if (flags.limitTrain > 0 && flags.limitTrain < train->size()) {
    train = randomSubset(train, flags.limitTrain, flags.seed);
  }
  if (flags.limitTest > 0 && flags.limitTest < test->size()) {
    test = randomSubset(test, flags.limitTest, flags.seed + 7);
  }
}

std::vector<double> evaluateSharded(
    Trainer& trainer, Communicator& comm, const Dataset& data, int64_t batchSize, AmpMode amp,
    int64_t sumCount,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& batchSums) {
  // Shares follow the current split (a slower rank evaluates fewer samples).
  const ItemRange shard = shardOf(data.size(), trainer.plan(), comm.rank());
  const int64_t begin = shard.begin;
  const int64_t end = shard.end;

  const c10::Device device = trainer.device();  // the rank's, not the communicator's
  at::Tensor total = at::zeros({sumCount}, at::TensorOptions().dtype(at::kDouble).device(device));
  torch::NoGradGuard noGrad;
  trainer.ddp().module().eval();
  std::optional<AutocastGuard> autocast;
  if (amp != AmpMode::Off) {
    autocast.emplace(device.type(), amp == AmpMode::Fp16 ? at::kHalf : at::kBFloat16);
  }
  SampleRng rng(0);  // evaluation data is not augmented; the rng is unused
  for (int64_t first = begin; first < end; first += batchSize) {
    const int64_t last = std::min(end, first + batchSize);
    std::vector<Example> examples;
    examples.reserve(static_cast<size_t>(last - first));
    for (int64_t i = first; i < last; ++i) {
      examples.push_back(data.get(i, rng));
    }
    Example batch = collate(examples);
    at::Tensor sums = batchSums(batch.input.to(device), batch.target.to(device));
    HDDP_CHECK(sums.dim() == 1 && sums.size(0) == sumCount, "evaluateSharded: batchSums returned ",
               sums.sizes(), ", expected [", sumCount, "]");
    total += sums.to(at::kDouble);
  }
  total = total.cpu().contiguous();
  return reduceValues(
      comm, std::vector<double>(total.data_ptr<double>(), total.data_ptr<double>() + sumCount));
}

bool evaluateThisEpoch(const CommonFlags& flags, int64_t epoch) {
  return (epoch + 1) % flags.evalEvery == 0 || epoch + 1 == flags.epochs;
}

void installEvaluation(Trainer& trainer, const CommonFlags& flags,
                       std::function<std::map<std::string, double>()> evaluate) {
  trainer.setEvaluation([&trainer, flags, evaluate = std::move(evaluate)](
                            int64_t epoch) -> std::map<std::string, double> {
    const bool stopped = trainer.stoppedEarly();
    if (!evaluateThisEpoch(flags, epoch) && !stopped) {
      return {};  // the Trainer keeps the last evaluation
    }
    return evaluate();
  });
}

}  // namespace examples
}  // namespace hddp
