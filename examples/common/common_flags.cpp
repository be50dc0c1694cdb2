// The trainers' common command-line flags (example_common.h): addCommonFlags registers
// each with its help, its default and the check of its value.
#include <CLI/CLI.hpp>
#include <string>

#include "cli_checks.h"
#include "example_common.h"
#include "hddp/balance/compression_model.h"
#include "hddp/core/error.h"
#include "hddp/ddp/sharded_optimizer.h"

namespace hddp {
namespace examples {

void addCommonFlags(CLI::App& app, CommonFlags& f) {
  app.add_option("--global-batch", f.globalBatch, "Samples per optimizer step over all ranks")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--epochs", f.epochs, "Passes over the training set")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--max-steps", f.maxSteps, "Stop after this many steps in total (0: no limit)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--time-budget", f.timeBudget,
                 "Stop training after this many seconds (0: no limit); the learning-rate "
                 "schedule ends with it. The final evaluation comes after")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--lr", f.lr, "Peak learning rate")->check(cli::positive())->capture_default_str();
  app.add_option("--schedule", f.schedule,
                 "Learning-rate schedule after warm-up: cosine (to 0), step (x0.1 at 50% and "
                 "75% of the steps) or constant")
      ->check(CLI::IsMember({"cosine", "step", "constant"}))
      ->capture_default_str();
  app.add_option("--warmup-epochs", f.warmupEpochs, "Linear learning-rate warm-up (epochs)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--optimizer", f.optimizer, "sgd (momentum, Nesterov) or adamw")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  app.add_option("--momentum", f.momentum, "SGD momentum")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--weight-decay", f.weightDecay, "Weight decay")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--amp", f.amp,
                 "Mixed precision: off, bf16 (CPU and CUDA; float32 where the device lacks "
                 "native bf16), fp16 (CUDA, dynamic loss scaling) or auto (bf16 where native, "
                 "else off)")
      ->check(CLI::IsMember({"off", "bf16", "fp16", "auto"}))
      ->capture_default_str();
  app.add_flag("--checkpoint-activations", f.checkpointActivations,
               "Recompute blocks in backward instead of storing their activations");
  app.add_option("--clip-grad-norm", f.clipGradNorm, "Clip the global gradient norm (0: off)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--workers", f.workers, "Data-loading threads per rank (0: load inline)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--prefetch", f.prefetch, "Batches prepared ahead per rank")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--save-dir", f.saveDir, "Write state files here (atomic, CRC-checked)");
  app.add_option("--save-every", f.saveEvery,
                 "Save every N steps (0: at the end of each epoch and of the run)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--resume", f.resume,
                 "Resume from a state file, or the newest valid one in a directory");
  app.add_option("--export", f.exportPaths,
                 "After training, write the model's state dict here for Python: FILE.pt "
                 "(torch.load(f, weights_only=True)) or FILE.safetensors; several files "
                 "repeated or comma-separated, e.g. --export model.pt,model.safetensors (so a "
                 "path cannot hold a comma)")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  auto* initFrom =
      app.add_option("--init-from", f.initFrom,
                     "Start from this state dict (.pt from torch.save(model.state_dict(), f), or "
                     ".safetensors), e.g. torchvision's weights for --model resnet18/34/50");
  app.add_option("--init-skip", f.initSkip,
                 "With --init-from: leave out the keys starting with PREFIX (repeatable), e.g. "
                 "fc. for a new classifier head")
      ->needs(initFrom)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--init-allow-int-float", f.initAllowIntFloat,
               "With --init-from: convert the file's integer tensors to the model's floating "
               "point ones and back (truncating) instead of refusing; float16/float64 into "
               "float32 are converted always, and logged")
      ->needs(initFrom);
  app.add_option("--eval-every", f.evalEvery, "Evaluate every N epochs (the last always)")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--eval-batch", f.evalBatch, "Evaluation batch per rank")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--threads", f.threads,
                 "Intra-op threads per rank (0: this host's cores / ranks on this host)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--metrics", f.metrics,
                 "JSON-lines metrics file (rank r > 0 writes NAME.rank<r>.EXT)");
  app.add_option("--timeline", f.timeline, "Chrome-trace / Perfetto timeline of every rank");
  app.add_option("--tensorboard", f.tensorboard,
                 "TensorBoard event files into this folder (rank 0; tensorboard --logdir DIR)");
  app.add_flag("!--no-balance", f.balance,
               "Equal split of the global batch (PyTorch DDP) instead of the planner's");
  app.add_option("--compress", f.compress,
                 "Gradient compression: none, fp16, bf16 (half the bytes), powersgd[:RANK] "
                 "(low-rank with error feedback, rank 1 by default; for slow links) or auto "
                 "(chosen from the slowest link and the backward it can hide behind)")
      ->check([](const std::string& v) -> std::string {
        if (v == "auto") {
          return {};
        }
        try {
          CompressionSpec::parse(v);
          return {};
        } catch (const ConfigError&) {
          return "'" + v +
                 "' is not none, fp16, bf16, powersgd, powersgd:RANK (RANK a whole "
                 "number from 1) or auto";
        }
      });
  app.add_option("--zero", f.zero,
                 "ZeRO: 0 plain data parallelism, 1 shard the optimizer state across ranks, 2 "
                 "the gradients too (sgd and adamw; not with --compress)")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  app.add_option("--shard-by", f.shardBy,
                 "With --zero: size the shards by free device memory (memory), equally "
                 "(equal) or by ratios per rank (1:3)")
      ->check([](const std::string& v) -> std::string {
        try {
          parseShardBy(v);
          return {};
        } catch (const ConfigError& e) {
          return e.what_without_backtrace();
        }
      })
      ->capture_default_str();
  app.add_option("--compress-start", f.compressStart,
                 "PowerSGD: plain allreduce for this many steps first (default: 10% of the "
                 "run's planned steps, at least 2)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--emulate-slowdown", f.emulateSlowdown,
                 "DEMO ONLY: stretch ranks' compute, e.g. 1:3 (rank 1 three times slower)");
  app.add_option("--emulate-link-gbps", f.emulateLinkGbps,
                 "DEMO ONLY: limit ranks' link, e.g. 1:2.8 (GB/s): their input copies, and "
                 "every collective to a ring over the slowest listed link");
  app.add_option("--emulate-link-latency-us", f.emulateLinkLatencyUs,
                 "DEMO ONLY: latency per message of the emulated link (microseconds)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--emulate-memory-cap", f.emulateMemoryCap,
                 "DEMO ONLY: ranks run out of memory above this many samples, e.g. 1:40");
  app.add_option("--emulate-memory", f.emulateMemory,
                 "DEMO ONLY: ranks' device memory in MiB, FIXED+PER_SAMPLE/TOTAL, e.g. "
                 "1:200+12/1000 (measured, caps derived from it, out of memory above TOTAL)");
  app.add_option("--max-local-batch", f.maxLocalBatch,
                 "Memory caps: the most samples a rank may get per step, e.g. 1:40 or 0:96,1:40 "
                 "(otherwise learned when a rank runs out of memory)");
  app.add_option("--seed", f.seed, "Seed of initialisation, shuffling and augmentation")
      ->capture_default_str();
  app.add_option("--limit-train", f.limitTrain, "Train on this many samples (0: all)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--limit-test", f.limitTest, "Evaluate on this many samples (0: all)")
      ->check(cli::nonNegative())
      ->capture_default_str();
  app.add_option("--device", f.device,
                 "This program's device: cpu, cuda or cuda:N (default: HDDP_DEVICE, which "
                 "hddp-run --devices sets, else cuda:<local rank> with CUDA, else cpu)");
  app.add_option("--log-every", f.logEvery,
                 "Progress lines every N steps (and at each epoch's last step); the --metrics "
                 "file has a record of every step")
      ->check(cli::positive())
      ->capture_default_str();
  app.add_option("--progress", f.progress, "auto (a live bar on a terminal), lines or off")
      ->check(CLI::IsMember({"auto", "lines", "off"}))
      ->capture_default_str();
}

}  // namespace examples
}  // namespace hddp
