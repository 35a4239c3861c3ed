#pragma once

// distill-run's command line.
//
//   distill-run [--nproc-per-node N] [--nnodes M --node-rank K --master-addr A
//               --master-port P] --config F [--set key=value]... [--log-dir D]
//               [--dry-run] [--stop-grace-s S] [--status-every-s S] -- TRAINER ARGS...
//
// Every option but --config, --set and --dry-run stands for a run.* config key
// (--nproc-per-node N is --set run.nproc_per_node=N, --log-dir D is
// run.log_dir, ...): validated by the config schema with the file, and handed
// to every rank with the --set ones in DISTILL_SET, so each rank runs the
// config checked here.

#include <optional>
#include <string>
#include <vector>

#include "distill/core/config.h"

namespace distill::launcher {

struct Args {
  std::string config;
  // --set and the options that stand for a config key, in the order given
  // (later ones win). The launcher validates them with the file through the
  // config schema, and every rank gets them in DISTILL_SET, so that the ranks
  // run the config the launcher checked.
  std::vector<ConfigOverride> overrides;
  bool dryRun = false;
  std::vector<std::string> trainer;
};

// The arguments, or nullopt when --help printed the help (exit 0). A problem
// is a ConfigError naming the option, with the usage.
std::optional<Args> parseArgs(int argc, char** argv);

} // namespace distill::launcher
