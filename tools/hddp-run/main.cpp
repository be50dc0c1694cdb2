// hddp-run: a local launcher in the spirit of `torchrun --standalone`.
//
//   hddp-run --nproc-per-node 2 -- ./train --epochs 3
//
// Starts N ranks with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...,
// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), prefixes their output with the
// rank, forwards Ctrl-C / SIGTERM, and when one rank fails ends the others within
// seconds and exits non-zero naming it. With --max-restarts K the whole group is
// restarted up to K times (TORCHELASTIC_RESTART_COUNT incremented) so a program can
// resume from its last saved state. --devices gives each local rank its device
// (HDDP_DEVICE), e.g. a GPU rank next to a CPU rank. --nproc-per-node MIN:MAX makes the
// job elastic: a rank that fails leaves, the others re-form from the newest commit, and
// its slot comes back when its check passes. See docs/launching.md and docs/elastic.md.
#include <CLI/CLI.hpp>
#include <iostream>

#include "cli_checks.h"
#include "launcher.h"

namespace {

bool isLoopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1" || host == "[::1]";
}

}  // namespace

int main(int argc, char** argv) {
  hddp::run::LaunchConfig config;
  CLI::App app{
      "hddp-run: start the ranks of a data-parallel job on this node.\n"
      "Usage: hddp-run [options] [--] program [args...]"};
  app.prefix_command();  // everything from the program name on is the command
  std::string nproc = "1";
  app.add_option("--nproc-per-node,--nproc_per_node", nproc,
                 "Ranks to start on this node: N, or MIN:MAX for an elastic job (ranks may "
                 "leave and come back; docs/elastic.md)")
      ->capture_default_str();
  app.add_option("--nnodes", config.nnodes, "Number of nodes in the job")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", config.nodeRank, "Index of this node (0..nnodes-1)")
      ->check(hddp::cli::nonNegative())
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", config.masterAddr,
                 "Address of the node that runs rank 0")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", config.masterPort,
                 "TCP port of the rendezvous store on rank 0's node (0 = pick a free port; "
                 "single node only)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--max-restarts,--max_restarts", config.maxRestarts,
                 "Restart the whole group up to this many times after a failure")
      ->check(hddp::cli::nonNegative())
      ->capture_default_str();
  app.add_option("--grace-period", config.graceSeconds,
                 "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(hddp::cli::positive())
      ->capture_default_str();
  bool standalone = false;
  app.add_flag("--standalone", standalone,
               "Single-node job (as torchrun --standalone): loopback only, a free port")
      ->excludes("--nnodes")
      ->excludes("--node-rank")
      ->excludes("--master-addr")
      ->excludes("--master-port");
  app.add_option("--devices", config.devices,
                 "One device per local rank, e.g. cuda:0,cpu (a GPU rank and a CPU rank); sets "
                 "--nproc-per-node when that is not given. Default: cuda:<local rank> with "
                 "CUDA, else cpu")
      ->delimiter(',');
  app.add_flag("--share-devices", config.shareDevices,
               "Let local ranks share a GPU in --devices (Gloo through host memory; testing)");
  app.add_flag("--no-prefix", config.noPrefix, "Do not prefix output lines with [rank N]");
  app.add_flag("!--no-tty", config.tty,
               "Give rank 0 a pipe for its stderr even when hddp-run's is a terminal (by "
               "default it gets a pseudo-terminal, so that its live progress bar shows)");
  app.add_option("--rejoin-check", config.rejoinCheck,
                 "Elastic: shell command that says (exit 0) whether a slot that left may come "
                 "back; it sees HDDP_SLOT and HDDP_SLOT_DEVICE. Default: a CPU slot may, a CUDA "
                 "slot when its device answers (hddp-probe --check-device)");
  app.add_option("--rejoin-every", config.rejoinEvery, "Elastic: seconds between rejoin checks")
      ->check(hddp::cli::positive())
      ->capture_default_str();
  app.add_option("--job-dir", config.jobDir,
                 "Elastic: the job's folder (commits unless the program has --save-dir, and "
                 "the job record that hddp-probe --job shows), kept after the job. Default: a "
                 "temporary folder, removed when the job succeeds");
  std::vector<std::string> unplugs;
  app.add_option("--emulate-unplug", unplugs,
                 "Elastic, emulation: SLOT@SECONDS[:BACK] kills slot SLOT's rank that many "
                 "seconds after the start; it may come back from BACK seconds on (e.g. 2@30:60)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (const std::string error = hddp::run::parseNproc(nproc, config); !error.empty()) {
    std::cerr << "hddp-run: " << error << "\n";
    return 2;
  }
  const bool elastic = config.minProcs > 0;
  for (const auto& u : unplugs) {
    if (const std::string error = hddp::run::parseUnplug(u, config); !error.empty()) {
      std::cerr << "hddp-run: " << error << "\n";
      return 2;
    }
  }
  if (!elastic &&
      (!unplugs.empty() || app.count("--rejoin-check") > 0 || app.count("--job-dir") > 0)) {
    std::cerr << "hddp-run: --emulate-unplug, --rejoin-check and --job-dir need an elastic job: "
                 "give "
                 "--nproc-per-node MIN:MAX (e.g. 2:3)\n";
    return 2;
  }
  if (elastic && config.nnodes > 1) {
    std::cerr << "hddp-run: --nproc-per-node MIN:MAX is for one node for now (--nnodes 1); "
                 "see docs/elastic.md\n";
    return 2;
  }
  if (elastic && app.count("--max-restarts") == 0) {
    config.maxRestarts = 10;  // failures the elastic job survives
  }
  config.probePath = hddp::run::siblingTool("hddp-probe");
  config.command = app.remaining();
  if (!config.command.empty() && config.command.front() == "--") {
    config.command.erase(config.command.begin());
  }
  if (config.command.empty()) {
    std::cerr << "hddp-run: no program given. Usage: hddp-run --nproc-per-node N -- program "
                 "[args...]\n";
    return 2;
  }
  if (const std::string error = hddp::run::checkDevices(config, app.count("--nproc-per-node") > 0);
      !error.empty()) {
    std::cerr << "hddp-run: " << error << "\n";
    return 2;
  }
  if (config.nodeRank >= config.nnodes) {
    std::cerr << "hddp-run: --node-rank " << config.nodeRank << " must be below --nnodes "
              << config.nnodes << "\n";
    return 2;
  }
  if (config.nnodes > 1 && (app.count("--master-addr") == 0 || isLoopback(config.masterAddr))) {
    std::cerr << "hddp-run: with --nnodes " << config.nnodes << " the other nodes must reach the "
              << "node of rank 0, but --master-addr is "
              << (app.count("--master-addr") == 0 ? "not given (default " : "") << config.masterAddr
              << (app.count("--master-addr") == 0 ? ")" : "")
              << ", a loopback address each node would dial on itself. Give every node the "
                 "same --master-addr: an address of node 0 on the network the nodes share "
                 "(e.g. --master-addr 10.0.0.5)\n";
    return 2;
  }
  if (config.nnodes > 1 && config.masterPort == 0) {
    std::cerr << "hddp-run: with --nnodes > 1 every node needs the same --master-port; "
                 "choose a free port on the node of rank 0\n";
    return 2;
  }
  return hddp::run::launch(config);
}
