// train_resnet: image classification with a ResNet on one or many ranks.
//
//   ./build/examples/resnet/train_resnet                       # ResNet-20, Fashion-MNIST
//   hddp-run --nproc-per-node 2 -- ./build/examples/resnet/train_resnet --epochs 5
//   torchrun --nproc-per-node 2 --no-python ./build/examples/resnet/train_resnet
//   srun --ntasks-per-node 4 ./build/examples/resnet/train_resnet --dataset cifar10 --data DIR
//
// Datasets: Fashion-MNIST / MNIST (IDX, .gz or not), CIFAR-10 (binary version), a folder
// of class subfolders (PNG, JPEG, BMP, ...: hddp::decodeImage), or synthetic patterns.
// Every epoch ends with the test accuracy and loss, evaluated in shards on all ranks.
#include <hddp/hddp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <tuple>

#include "cli_checks.h"
#include "example_common.h"
#include "resnet.h"

namespace ex = hddp::examples;

namespace {

struct Data {
  std::shared_ptr<const hddp::Dataset> train;
  std::shared_ptr<const hddp::Dataset> test;
  int64_t channels = 1;
  int64_t imageSize = 28;
  int64_t classes = 10;
};

enum class Augment {
  None,
  /// A random crop after zero padding (4 px for 32 px images, 2 px below).
  Crop,
  /// The crop and random horizontal flips (clothes and objects, not digits).
  CropAndFlip,
};

// Normalisation by the training set's channel statistics, then `augment`.
hddp::ImageTransform standardTransform(std::pair<std::vector<float>, std::vector<float>> stats,
                                       int64_t size, Augment augment) {
  hddp::ImageTransform t;
  t.mean = std::move(stats.first);
  t.std = std::move(stats.second);
  if (augment != Augment::None) {
    t.padCrop = size >= 32 ? 4 : 2;
    t.horizontalFlip = augment == Augment::CropAndFlip;
  }
  return t;
}

Data loadData(const std::string& kind, std::string dir, const std::string& testDir,
              int64_t imageSize, int64_t channels, double valFraction, uint64_t seed,
              bool augment) {
  Data d;
  if (kind == "fashion-mnist" || kind == "mnist" || kind == "cifar10") {
    if (dir.empty()) {
      HDDP_CHECK_AS(hddp::ConfigError, kind == "fashion-mnist", "--dataset ", kind,
                    " needs --data DIR (the folder holding its files)");
      dir = "/usr/share/datasets/fashion-mnist";
    }
    std::shared_ptr<hddp::ImageClassificationDataset> train;
    std::shared_ptr<hddp::ImageClassificationDataset> test;
    if (kind == "cifar10") {
      train = hddp::loadCifar10(dir, hddp::Split::Train);
      test = hddp::loadCifar10(dir, hddp::Split::Test);
    } else {
      train = hddp::loadMnist(dir, hddp::Split::Train);
      test = hddp::loadMnist(dir, hddp::Split::Test);
    }
    // Flips suit clothes and objects, not digits.
    const Augment trainAugment = !augment          ? Augment::None
                                 : kind == "mnist" ? Augment::Crop
                                                   : Augment::CropAndFlip;
    auto stats = train->channelStats();
    train->setTransform(standardTransform(stats, train->height(), trainAugment));
    test->setTransform(standardTransform(stats, train->height(), Augment::None));
    d.channels = train->channels();
    d.imageSize = train->height();
    d.classes = train->classes();
    d.train = train;
    d.test = test;
  } else if (kind == "folder") {
    HDDP_CHECK_AS(hddp::ConfigError, !dir.empty(),
                  "--dataset folder needs --data DIR with one subfolder of images per class");
    const int size = static_cast<int>(imageSize > 0 ? imageSize : 32);
    auto train = std::make_shared<hddp::ImageFolderDataset>(dir, static_cast<int>(channels), size);
    hddp::ImageTransform t;
    t.mean.assign(static_cast<size_t>(channels), 0.5f);
    t.std.assign(static_cast<size_t>(channels), 0.25f);
    hddp::ImageTransform evalT = t;
    if (augment) {
      t.padCrop = size >= 32 ? 4 : 2;
      t.horizontalFlip = true;
    }
    d.channels = channels;
    d.imageSize = size;
    d.classes = train->classes();
    if (!testDir.empty()) {
      auto test =
          std::make_shared<hddp::ImageFolderDataset>(testDir, static_cast<int>(channels), size);
      HDDP_CHECK_AS(hddp::ConfigError, test->classNames() == train->classNames(), "--test-data ",
                    testDir, " has other class subfolders than --data ", dir);
      test->setTransform(evalT);
      train->setTransform(t);
      d.train = train;
      d.test = test;
    } else {
      // No test folder: hold out a seeded random fraction of the training folder.
      auto evalView =
          std::make_shared<hddp::ImageFolderDataset>(dir, static_cast<int>(channels), size);
      evalView->setTransform(evalT);
      train->setTransform(t);
      std::tie(d.train, d.test) = ex::holdOut(train, evalView, valFraction, seed);
    }
  } else {  // synthetic
    const int size = static_cast<int>(imageSize > 0 ? imageSize : 28);
    d.channels = channels;
    d.imageSize = size;
    d.classes = 10;
    // One seeded set of class patterns; disjoint samples for training and testing.
    auto all = std::make_shared<hddp::SyntheticClassificationDataset>(
        5120, static_cast<int>(channels), size, d.classes, seed + 1);
    d.test = ex::randomSubset(all, 1024, seed, 0);
    d.train = ex::randomSubset(all, 4096, seed, 1024);
  }
  return d;
}

int run(int argc, char** argv) {
  CLI::App app{
      "Trains a ResNet for image classification with hddp, on one rank or under hddp-run, "
      "torchrun --no-python, Slurm or mpirun. Prints the test accuracy after every epoch.",
      "train_resnet"};
  std::string model = "resnet20";
  std::string stem = "auto";
  std::string dataset = "fashion-mnist";
  std::string data;
  std::string testData;
  int64_t imageSize = 0;
  int64_t channels = 3;
  double valFraction = 0.1;
  bool syncBn = false;
  bool noAugment = false;
  bool evalFlip = false;
  double labelSmoothing = 0.0;
  // A flag given twice takes the last value (scripts append overrides to defaults).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  ex::CommonFlags flags;
  app.add_option("--model", model,
                 "resnet9, resnet20, resnet32, resnet56, resnet18, resnet34, resnet50")
      ->check(CLI::IsMember(
          {"resnet9", "resnet20", "resnet32", "resnet56", "resnet18", "resnet34", "resnet50"}))
      ->capture_default_str();
  app.add_option("--stem", stem,
                 "resnet18/34/50's first layers: cifar (3x3 conv, no max-pool), torchvision "
                 "(7x7/2 conv and max-pool, as torchvision.models: its state dicts load with "
                 "--init-from and --export's load into it unchanged) or auto (cifar for images "
                 "of 64 px or less, torchvision above)")
      ->check(CLI::IsMember({"auto", "cifar", "torchvision"}))
      ->capture_default_str();
  app.add_option("--dataset", dataset, "fashion-mnist, mnist, cifar10, folder or synthetic")
      ->check(CLI::IsMember({"fashion-mnist", "mnist", "cifar10", "folder", "synthetic"}))
      ->capture_default_str();
  app.add_option("--data", data,
                 "Dataset folder (default for fashion-mnist: /usr/share/datasets/fashion-mnist, "
                 "Debian's dataset-fashion-mnist)");
  app.add_option("--test-data", testData,
                 "folder: a test folder with the same class subfolders (default: hold out "
                 "--val-fraction of --data)");
  app.add_option("--val-fraction", valFraction, "folder: fraction held out for evaluation")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--image-size", imageSize,
                 "folder/synthetic: image side in pixels (default 32 / 28)")
      ->check(hddp::cli::nonNegative());
  app.add_option("--channels", channels, "folder/synthetic: 1 (grey) or 3 (RGB)")
      ->check(CLI::IsMember({1, 3}))
      ->capture_default_str();
  app.add_flag("--sync-bn", syncBn, "Batch-norm statistics over all ranks' samples");
  app.add_flag("--no-augment", noAugment, "No random crops or flips");
  app.add_option("--label-smoothing", labelSmoothing,
                 "Mix each target with the uniform distribution by this much (0: off)")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  app.add_flag("--eval-flip", evalFlip,
               "Evaluate on the mean of the logits of each test image and its mirror image "
               "(test-time augmentation; for data whose classes are left-right symmetric)");
  flags.lr = 0.1;
  flags.epochs = 1;
  ex::addCommonFlags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  HDDP_CHECK_AS(
      hddp::ConfigError,
      stem != "torchvision" || model == "resnet18" || model == "resnet34" || model == "resnet50",
      "--stem torchvision is for resnet18, resnet34 and resnet50; --model ", model,
      " has its own 3x3 stem");
  auto ctx = ex::initRank(flags);
  ex::checkExportPath(flags, *ctx.communicator);
  const int threads = ex::applyThreads(flags, ctx);
  torch::manual_seed(flags.seed);  // identical initial weights on every rank (DDP checks)
  Data d =
      loadData(dataset, data, testData, imageSize, channels, valFraction, flags.seed, !noAugment);
  ex::applyLimits(flags, d.train, d.test);

  hddp::models::ResNetOptions mo;
  mo.arch = model;
  mo.inChannels = d.channels;
  mo.numClasses = d.classes;
  mo.imageSize = d.imageSize;
  mo.stem = hddp::models::parseResNetStem(stem);
  mo.syncBatchNorm = syncBn;
  mo.checkpointActivations = flags.checkpointActivations;
  hddp::models::ResNet net(mo);
  if (syncBn) {
    hddp::convertSyncBatchNorm(*net, *ctx.communicator);
  }
  ex::initModelFrom(*net, flags, *ctx.communicator);
  net->to(ctx.device);
  auto optimizer = ex::makeOptimizer(net->parameters(), flags);
  auto options = ex::trainerOptions(flags, ctx, d.train->size());
  if (ctx.rank() == 0) {
    std::printf(
        "train_resnet: %s on %s, %d rank(s) x %d thread(s), device %s\n  train: %s\n  test: %s\n",
        model.c_str(), dataset.c_str(), ctx.worldSize(), threads, ctx.device.str().c_str(),
        d.train->describe().c_str(), d.test->describe().c_str());
    std::fflush(stdout);
  }
  hddp::Trainer trainer(*ctx.communicator, net.ptr(), hddp::forwardOf(net),
                        hddp::crossEntropy(labelSmoothing), *optimizer, d.train, options);
  ex::installSchedule(trainer, flags, d.train->size());
  ex::installEvaluation(trainer, flags, [&]() -> std::map<std::string, double> {
    namespace F = torch::nn::functional;
    // [loss sum, correct, samples, correct without the mirror image]
    auto sums = ex::evaluateSharded(
        trainer, *ctx.communicator, *d.test, flags.evalBatch, trainer.ampMode(), 4,
        [&](const at::Tensor& x, const at::Tensor& y) {
          const auto plain = net->forward(x).to(at::kFloat);
          auto logits = plain;
          if (evalFlip) {
            logits = 0.5 * (plain + net->forward(x.flip({3})).to(at::kFloat));
          }
          return torch::stack(
              {F::cross_entropy(logits, y, F::CrossEntropyFuncOptions().reduction(torch::kSum)),
               logits.argmax(1).eq(y).sum().to(at::kFloat),
               torch::scalar_tensor(static_cast<double>(y.size(0)), logits.options()),
               plain.argmax(1).eq(y).sum().to(at::kFloat)});
        });
    std::map<std::string, double> metrics{{"test_acc", sums[1] / sums[2]},
                                          {"test_loss", sums[0] / sums[2]}};
    if (evalFlip) {
      metrics["test_acc_unflipped"] = sums[3] / sums[2];
    }
    return metrics;
  });
  auto summary = trainer.fit();
  ex::exportModel(*net, flags, ctx.rank());
  if (ctx.rank() == 0) {
    auto acc = summary.lastEvaluation.find("test_acc");
    if (acc != summary.lastEvaluation.end()) {
      std::fprintf(
          stderr, "test accuracy %.4f, test loss %.4f (%lld steps, %.1f s, %.0f samples/s)\n",
          acc->second, summary.lastEvaluation.at("test_loss"),
          static_cast<long long>(summary.totalSteps), summary.seconds, summary.samplesPerSecond);
    }
    std::fflush(stderr);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return ex::runMain("train_resnet", [&] { return run(argc, argv); });
}
