// What the Trainer checks of what it is given before it builds anything, and the
// communicator its collectives go through (internal to the train layer).
#pragma once

#include <c10/core/Device.h>

#include <memory>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace hddp {

class Communicator;
class Dataset;
struct TrainerOptions;

namespace train {

/// The options, the dataset and the device, checked on this rank alone (the Trainer
/// agrees the outcome): hddp::ConfigError saying what is wrong and what to do.
void checkOptions(const TrainerOptions& o, const Dataset* train, const Communicator& comm,
                  const c10::Device& device);

/// An optimizer that lists one tensor twice (built from parameters() of a model with tied
/// weights) would apply its update twice: a ConfigError naming the tensor.
void checkOptimizerListsEachTensorOnce(torch::optim::Optimizer& optimizer,
                                       const torch::nn::Module& model);

/// The communicator the Trainer's collectives go through: `comm` under an emulated slow
/// link when the emulation asks for one (every rank computes the same link from the
/// job's list), else null (use `comm`).
std::unique_ptr<Communicator> emulatedLinkFor(Communicator& comm, const TrainerOptions& options);

}  // namespace train
}  // namespace hddp
