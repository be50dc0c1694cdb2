// A small program for launcher tests: joins the job from the environment (as a user's
// program would under hddp-run, torchrun, srun or mpirun) and does what argv says.
//   worker allreduce            allreduce a ones tensor, print "sum=<value> restart=<n>
//                               launcher=<name> device=<device> backend=<backend>"
//   worker fail RANK CODE       rank RANK exits with CODE after joining; the others wait
//   worker fail-once RANK CODE  like fail, but only when TORCHELASTIC_RESTART_COUNT is 0
//   worker listening            after an allreduce, prints each TCP socket this process
//                               listens on: "listen ADDR loopback" or "listen ADDR EXPOSED"
//   worker elastic-train DIR [SAVE [EPOCHS [MS]]]
//                               trains a small MLP with the Trainer (planner on, 30 steps
//                               of 24 samples per epoch, 5 epochs, MS = 40 ms of sleep in
//                               each forward; SAVE: the save folder, "-" none); rank 0
//                               writes the parameters to DIR/final.pt
//   worker same-params A B      exits 0 when the parameter files A and B (elastic-train's
//                               final.pt) agree to rtol 1e-4, atol 1e-5; prints the
//                               largest difference
//   worker state-dict-copy IN OUT
//                               reads the state dict IN (torch.save's .pt or .safetensors)
//                               and writes it to OUT (format by extension); prints
//                               "copied N tensors"
//   worker cascade DIR          rank 1 writes its pid to DIR/pid, leaves a child that
//                               holds its output open and kills itself (SIGKILL); rank 0 exits with
//                               code 1 as soon as rank 1 has ended (as a peer that loses its
//                               connection does); the others wait
#include <ATen/ATen.h>
#include <dirent.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "hddp/hddp.h"

namespace {

// The inodes of this process's sockets.
std::set<std::string> ownSocketInodes() {
  std::set<std::string> inodes;
  DIR* dir = opendir("/proc/self/fd");
  while (dir) {
    dirent* e = readdir(dir);
    if (!e) {
      break;
    }
    char target[256] = {0};
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    const std::string t(target, n > 0 ? static_cast<size_t>(n) : 0);
    if (t.rfind("socket:[", 0) == 0) {
      inodes.insert(t.substr(8, t.size() - 9));
    }
  }
  if (dir) {
    closedir(dir);
  }
  return inodes;
}

// Prints this process's listening TCP sockets from /proc/net/tcp and tcp6.
void printListening() {
  const auto inodes = ownSocketInodes();
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || !inodes.count(inode)) {
        continue;  // not listening, or another process's
      }
      const std::string addr = local.substr(0, local.find(':'));
      const bool loopback = addr == "0100007F" || addr == "00000000000000000000000001000000" ||
                            addr == "0000000000000000FFFF00000100007F";
      std::printf("listen %s %s\n", local.c_str(), loopback ? "loopback" : "EXPOSED");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "allreduce";
  if (mode == "state-dict-copy" && argc > 3) {
    const auto tensors = hddp::readStateDict(argv[2]);
    std::vector<std::pair<std::string, at::Tensor>> ordered(tensors.begin(), tensors.end());
    hddp::writeStateDict(ordered, argv[3]);
    std::printf("copied %zu tensors\n", ordered.size());
    return 0;
  }
  if (mode == "same-params" && argc > 3) {
    std::vector<at::Tensor> a, b;
    torch::load(a, argv[2]);
    torch::load(b, argv[3]);
    bool same = a.size() == b.size();
    double largest = 0;
    for (size_t i = 0; same && i < a.size(); ++i) {
      same = a[i].sizes() == b[i].sizes() && at::allclose(a[i], b[i], 1e-4, 1e-5);
      if (a[i].sizes() == b[i].sizes()) {
        largest = std::max(largest, (a[i] - b[i]).abs().max().item<double>());
      }
    }
    std::printf("%zu and %zu tensors, largest difference %g\n", a.size(), b.size(), largest);
    return same ? 0 : 1;
  }
  try {
    auto ctx = hddp::initFromEnv();
    const int restart = ctx.info.restartCount;
    if (mode == "fail" || mode == "fail-once") {
      const int failRank = std::atoi(argv[2]);
      const int code = std::atoi(argv[3]);
      if (ctx.rank() == failRank && (mode == "fail" || restart == 0)) {
        std::fprintf(stderr, "worker: rank %d failing on purpose with %d\n", failRank, code);
        return code;
      }
      if (mode == "fail" || restart == 0) {
        std::this_thread::sleep_for(std::chrono::minutes(10));  // hddp-run must stop us
        return 0;
      }
    }
    if (mode == "elastic-train") {
      torch::manual_seed(7);  // one initial model (DDP broadcasts rank 0's anyway)
      torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(16, 32), torch::nn::Tanh(),
                                torch::nn::Linear(32, 4));
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      hddp::TrainerOptions o;
      o.globalBatch = 24;
      o.epochs = argc > 4 ? std::atoi(argv[4]) : 5;  // 720 samples: 30 steps per epoch
      if (argc > 3 && std::string(argv[3]) != "-") {
        o.saveDir = argv[3];
      }
      const int sleepMs = argc > 5 ? std::atoi(argv[5]) : 40;
      o.balance = true;
      o.progress = hddp::ProgressMode::Off;
      o.loader.workers = 0;
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(720, 1, 4, 4, /*seed=*/1);
      auto forward = [net, sleepMs](const torch::Tensor& x) mutable {
        std::this_thread::sleep_for(std::chrono::milliseconds(sleepMs));
        return net->forward(x);
      };
      hddp::Trainer trainer(*ctx.communicator, net.ptr(), forward, hddp::crossEntropy(), opt, ds,
                            o);
      const auto summary = trainer.fit();
      if (ctx.rank() == 0) {
        std::vector<at::Tensor> params;
        for (const auto& p : net->parameters()) {
          params.push_back(p.detach().clone());
        }
        torch::save(params, std::string(argv[2]) + "/final.pt");
      }
      std::printf("trained %lld steps (%lld in this run)\n",
                  static_cast<long long>(summary.totalSteps),
                  static_cast<long long>(summary.steps));
      return 0;
    }
    if (mode == "cascade") {
      const std::string pidFile = std::string(argv[2]) + "/pid";
      if (ctx.rank() == 1) {
        std::ofstream(pidFile + ".tmp") << getpid() << "\n";
        std::rename((pidFile + ".tmp").c_str(), pidFile.c_str());
        // A child keeps this rank's output pipes open, so its death does not wake the
        // launcher through them (as when a rank's own children outlive it).
        if (fork() == 0) {
          std::this_thread::sleep_for(std::chrono::seconds(3));
          _exit(0);
        }
        raise(SIGKILL);
      }
      if (ctx.rank() == 0) {
        long pid = 0;
        while (!(std::ifstream(pidFile) >> pid)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        // Ended = gone, or a zombie whose threads have all exited. The leader of a
        // multi-threaded process shows "Z" while its other threads (Gloo's) still exit,
        // and its parent can reap it only after the last one: leaving at the first "Z"
        // let the launcher see this rank end first now and then.
        while (true) {
          const std::string proc = "/proc/" + std::to_string(pid);
          std::ifstream stat(proc + "/stat");
          std::string field;
          std::string state;
          if (!(stat >> field >> field >> state)) {
            break;
          }
          if (state == "Z") {
            int threads = 0;
            if (DIR* tasks = opendir((proc + "/task").c_str())) {
              while (dirent* e = readdir(tasks)) {
                threads += e->d_name[0] != '.' ? 1 : 0;
              }
              closedir(tasks);
            }
            if (threads <= 1) {
              break;
            }
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        // At once and silently: output, or the slow teardown of a normal exit, would let
        // the launcher see rank 1 alone first even without waking on SIGCHLD.
        _exit(1);
      }
      std::this_thread::sleep_for(std::chrono::minutes(10));
      return 0;
    }
    at::Tensor t = at::ones({4});
    ctx.communicator->allreduce(t).wait();
    if (mode == "listening") {
      printListening();
      std::fflush(stdout);
      ctx.communicator->allreduce(t).wait();  // nobody leaves before all have looked
    }
    std::printf("sum=%g restart=%d launcher=%s device=%s backend=%s\n", t[0].item<double>(),
                restart, hddp::launcherName(ctx.info.launcher), ctx.device.str().c_str(),
                hddp::backendName(ctx.communicator->backend()));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker failed: %s\n", e.what());
    return 1;
  }
}
