// docs/ddp.md's first example, compiled: the lines between the markers are the doc's
// C++ block as it is (docs.ddp_md_shows_the_compiled_example checks that they match).
// Compiled into hddp_tests; not run (initFromEnv would meet a launcher's ranks).
#include <hddp/hddp.h>
#include <torch/torch.h>

#include <cstdio>
#include <utility>
#include <vector>

namespace ddp_doc_example {

// [docs/ddp.md begin]
struct MyNet : torch::nn::Module {
  MyNet() { fc = register_module("fc", torch::nn::Linear(784, 10)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x.flatten(1)); }
  torch::nn::Linear fc{nullptr};
};

void train(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
           int64_t globalBatch) {
  auto ctx = hddp::initFromEnv();
  MyNet model;  // or std::make_shared<MyNet>(), or a TORCH_MODULE holder
  hddp::DistributedDataParallel ddp(model, *ctx.communicator);  // checks, broadcasts rank 0's
  torch::optim::SGD opt(model.parameters(), 0.1);
  for (const auto& [x, y] : batches) {     // x: this rank's share of the step
    ddp.setBatch(x.size(0), globalBatch);  // b_i and B
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model.forward(x), y);  // mean over the local batch
    loss.backward();                                             // gradients synchronized here
    opt.step();
    double mean = hddp::globalMeanLoss(*ctx.communicator, loss, x.size(0));  // over all B
    if (ctx.rank() == 0) {
      std::printf("loss %.4f\n", mean);
    }
  }
}
// [docs/ddp.md end]

}  // namespace ddp_doc_example
