// hddp_resnet_forward: hddp's ResNet on an input batch, for the checks against
// torchvision (tests/models/resnet_torchvision_test.py).
//
//   hddp_resnet_forward ARCH CLASSES IMAGE_SIZE STATE_DICT INPUT OUTPUT
//
// Builds hddp::models::ResNet (3 input channels; IMAGE_SIZE picks the stem), loads
// STATE_DICT (.pt or .safetensors, strict), and writes the eval-mode logits of the
// tensor "input" in the state-dict file INPUT to OUTPUT as {"output": logits}.
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "hddp/hddp.h"
#include "resnet.h"

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s ARCH CLASSES IMAGE_SIZE STATE_DICT INPUT OUTPUT\n", argv[0]);
    return 2;
  }
  try {
    hddp::models::ResNetOptions o;
    o.arch = argv[1];
    o.numClasses = std::stoll(argv[2]);
    o.imageSize = std::stoll(argv[3]);
    hddp::models::ResNet net(o);
    const auto result = hddp::loadStateDict(*net, argv[4]);
    const auto inputs = hddp::readStateDict(argv[5]);
    const auto input = inputs.find("input");
    if (input == inputs.end()) {
      std::fprintf(stderr, "%s holds no tensor named 'input'\n", argv[5]);
      return 2;
    }
    net->eval();
    torch::NoGradGuard noGrad;
    const auto output = net->forward(input->second);
    hddp::writeStateDict({{"output", output}}, argv[6]);
    std::printf("loaded %zu tensors; output %s\n", result.loaded.size(),
                c10::str(output.sizes()).c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hddp_resnet_forward: %s\n", e.what());
    return 1;
  }
}
