// train_unet: semantic segmentation with a 2D U-Net on one or many ranks.
//
//   ./build/examples/unet/train_unet                          # synthetic shapes, 64 px
//   hddp-run --nproc-per-node 2 -- ./build/examples/unet/train_unet --checkpoint-activations
//   ./build/examples/unet/train_unet --dataset folder --data DIR   # DIR/images, DIR/masks
//
// Reports per-pixel accuracy, mean IoU and mean Dice over the foreground classes after
// every epoch (evaluated in shards on all ranks, one allreduce of the counts).
#include <hddp/hddp.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <tuple>

#include "cli_checks.h"
#include "example_common.h"
#include "unet.h"

namespace ex = hddp::examples;

namespace {

int run(int argc, char** argv) {
  CLI::App app{
      "Trains a U-Net for segmentation with hddp, on one rank or under hddp-run, torchrun "
      "--no-python, Slurm or mpirun. Prints pixel accuracy, mean IoU and Dice every epoch.",
      "train_unet"};
  std::string dataset = "shapes";
  std::string data;
  std::string testData;
  int64_t imageSize = 64;
  int64_t channels = 1;
  int64_t samples = 2048;
  int64_t testSamples = 256;
  double valFraction = 0.1;
  int64_t depth = 3;
  int64_t baseWidth = 16;
  bool noBatchNorm = false;
  bool noAugment = false;
  // A flag given twice takes the last value (scripts append overrides to defaults).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  ex::CommonFlags flags;
  flags.optimizer = "adamw";
  flags.lr = 2e-3;
  flags.weightDecay = 1e-4;
  flags.globalBatch = 32;
  flags.evalBatch = 32;
  flags.epochs = 4;
  app.add_option("--dataset", dataset,
                 "shapes (synthetic ellipses and polygons, exact masks) or folder "
                 "(DIR/images/NAME.png with DIR/masks/NAME.png holding class ids)")
      ->check(CLI::IsMember({"shapes", "folder"}))
      ->capture_default_str();
  app.add_option("--data", data, "folder: the folder holding images/ and masks/");
  app.add_option("--test-data", testData,
                 "folder: a test folder of the same layout (default: hold out --val-fraction)");
  app.add_option("--val-fraction", valFraction, "folder: fraction held out for evaluation")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--image-size", imageSize,
                 "Image side in pixels (a multiple of 2^depth; folder images are resized)")
      ->check(hddp::cli::positive())
      ->capture_default_str();
  app.add_option("--channels", channels, "Input channels: 1 (grey) or 3 (RGB)")
      ->check(CLI::IsMember({1, 3}))
      ->capture_default_str();
  app.add_option("--samples", samples, "shapes: training images")
      ->check(hddp::cli::positive())
      ->capture_default_str();
  app.add_option("--test-samples", testSamples, "shapes: test images")
      ->check(hddp::cli::positive())
      ->capture_default_str();
  app.add_option("--depth", depth, "U-Net levels (down-samplings)")
      ->check(CLI::Range(1, 6))
      ->capture_default_str();
  app.add_option("--base-width", baseWidth, "Channels of the first level (doubled per level)")
      ->check(hddp::cli::positive())
      ->capture_default_str();
  app.add_flag("--no-batch-norm", noBatchNorm, "Plain convolutions without batch norm");
  app.add_flag("--no-augment", noAugment, "folder: no random crops or flips");
  ex::addCommonFlags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  HDDP_CHECK_AS(hddp::ConfigError, imageSize % (int64_t{1} << depth) == 0, "--image-size ",
                imageSize, " is not a multiple of 2^depth = ", int64_t{1} << depth,
                "; pick a size divisible by it or a smaller --depth");

  auto ctx = ex::initRank(flags);
  ex::checkExportPath(flags, *ctx.communicator);
  const int threads = ex::applyThreads(flags, ctx);
  torch::manual_seed(flags.seed);
  std::shared_ptr<const hddp::Dataset> train;
  std::shared_ptr<const hddp::Dataset> test;
  int64_t classes = hddp::SyntheticShapesDataset::kClasses;
  if (dataset == "shapes") {
    train = std::make_shared<hddp::SyntheticShapesDataset>(
        samples, static_cast<int>(imageSize), flags.seed + 1, static_cast<int>(channels));
    // Another seed: other shapes.
    test = std::make_shared<hddp::SyntheticShapesDataset>(
        testSamples, static_cast<int>(imageSize), flags.seed + 1000003, static_cast<int>(channels));
  } else {
    HDDP_CHECK_AS(hddp::ConfigError, !data.empty(),
                  "--dataset folder needs --data DIR holding images/ and masks/");
    auto make = [&](const std::string& dir, bool augment) {
      auto ds = std::make_shared<hddp::SegmentationFolderDataset>(dir, static_cast<int>(channels),
                                                                  static_cast<int>(imageSize));
      hddp::ImageTransform t;
      t.mean.assign(static_cast<size_t>(channels), 0.5f);
      t.std.assign(static_cast<size_t>(channels), 0.25f);
      if (augment) {
        t.padCrop = static_cast<int>(imageSize / 16);
        t.horizontalFlip = true;
      }
      ds->setTransform(t);
      return ds;
    };
    auto trainFolder = make(data, !noAugment);
    classes = trainFolder->classes();
    if (!testData.empty()) {
      auto testFolder = make(testData, false);
      classes = std::max(classes, testFolder->classes());
      train = trainFolder;
      test = testFolder;
    } else {
      std::tie(train, test) = ex::holdOut(trainFolder, make(data, false), valFraction, flags.seed);
    }
  }
  ex::applyLimits(flags, train, test);

  hddp::models::UNetOptions mo;
  mo.inChannels = channels;
  mo.numClasses = classes;
  mo.depth = depth;
  mo.baseWidth = baseWidth;
  mo.batchNorm = !noBatchNorm;
  mo.checkpointActivations = flags.checkpointActivations;
  hddp::models::UNet net(mo);
  ex::initModelFrom(*net, flags, *ctx.communicator);
  net->to(ctx.device);
  auto optimizer = ex::makeOptimizer(net->parameters(), flags);
  auto options = ex::trainerOptions(flags, ctx, train->size());
  if (ctx.rank() == 0) {
    std::printf(
        "train_unet: depth %lld, width %lld, %lld classes, %d rank(s) x %d thread(s), device "
        "%s\n  train: %s\n  test: %s\n",
        static_cast<long long>(depth), static_cast<long long>(baseWidth),
        static_cast<long long>(classes), ctx.worldSize(), threads, ctx.device.str().c_str(),
        train->describe().c_str(), test->describe().c_str());
    std::fflush(stdout);
  }
  hddp::Trainer trainer(*ctx.communicator, net.ptr(), hddp::forwardOf(net), hddp::crossEntropy(),
                        *optimizer, train, options);
  ex::installSchedule(trainer, flags, train->size());
  // Sums: loss, pixels, correct pixels, then per class: intersection, predicted, actual.
  const int64_t k = classes;
  ex::installEvaluation(trainer, flags, [&]() -> std::map<std::string, double> {
    namespace F = torch::nn::functional;
    auto s = ex::evaluateSharded(
        trainer, *ctx.communicator, *test, flags.evalBatch, trainer.ampMode(), 3 + 3 * k,
        [&](const at::Tensor& x, const at::Tensor& y) {
          auto logits = net->forward(x).to(at::kFloat);
          auto pred = logits.argmax(1);
          auto ids = torch::arange(k, y.options()).view({k, 1});
          auto p = pred.flatten().unsqueeze(0).eq(ids);  // [k, pixels]
          auto t = y.flatten().unsqueeze(0).eq(ids);
          auto perClass = torch::stack({p.logical_and(t).sum(1), p.sum(1), t.sum(1)}, 1);
          return torch::cat(
              {torch::stack({F::cross_entropy(logits, y,
                                              F::CrossEntropyFuncOptions().reduction(torch::kSum)),
                             torch::scalar_tensor(static_cast<double>(y.numel()), logits.options()),
                             pred.eq(y).sum().to(at::kFloat)}),
               perClass.flatten().to(at::kFloat)});
        });
    double iou = 0;
    double dice = 0;
    int counted = 0;
    for (int64_t c = 1; c < k; ++c) {  // foreground classes present in truth or prediction
      const double inter = s[static_cast<size_t>(3 + 3 * c)];
      const double both = s[static_cast<size_t>(4 + 3 * c)] + s[static_cast<size_t>(5 + 3 * c)];
      if (both > 0) {
        iou += inter / (both - inter);
        dice += 2 * inter / both;
        ++counted;
      }
    }
    return {{"test_loss", s[0] / s[1]},
            {"pixel_acc", s[2] / s[1]},
            {"mean_iou", counted ? iou / counted : 0.0},
            {"dice", counted ? dice / counted : 0.0}};
  });
  auto summary = trainer.fit();
  ex::exportModel(*net, flags, ctx.rank());
  if (ctx.rank() == 0 && summary.lastEvaluation.count("mean_iou")) {
    const auto& e = summary.lastEvaluation;
    std::fprintf(
        stderr,
        "test mean IoU %.4f, Dice %.4f, pixel accuracy %.4f, loss %.4f (%lld steps, %.1f s)\n",
        e.at("mean_iou"), e.at("dice"), e.at("pixel_acc"), e.at("test_loss"),
        static_cast<long long>(summary.totalSteps), summary.seconds);
    std::fflush(stderr);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return ex::runMain("train_unet", [&] { return run(argc, argv); });
}
