// The Trainer writes the loop: data, split, AMP, metrics, resume (docs/quickstart.md).
//   hddp-run --nproc-per-node 2 -- ./build/examples/quickstart/trainer_quickstart
#include <hddp/hddp.h>
#include <torch/torch.h>

int main() {
  auto ctx = hddp::initFromEnv();  // hddp-run, torchrun, Slurm or mpirun
  auto train = hddp::loadMnist("/usr/share/datasets/fashion-mnist", hddp::Split::Train);
  auto [mean, stdev] = train->channelStats();
  train->setTransform({mean, stdev, /*padCrop=*/2, /*horizontalFlip=*/true});
  torch::manual_seed(0);  // the same initial weights on every rank
  torch::nn::Sequential model(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)),
                              torch::nn::ReLU(), torch::nn::MaxPool2d(4), torch::nn::Flatten(),
                              torch::nn::Linear(32 * 7 * 7, 10));
  model->to(ctx.device);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  hddp::TrainerOptions options;
  options.globalBatch = 128;
  options.epochs = 2;
  options.amp = hddp::AmpMode::Bf16;
  hddp::Trainer trainer(*ctx.communicator, model.ptr(), hddp::forwardOf(model),
                        hddp::crossEntropy(), opt, train, options);
  trainer.fit();
}
