// distill-run: starts the local ranks of one node of a distill job (docs/launching.md). args.h: the command line; supervisor.h: what it does.

#include "args.h"
#include "distill/core/logging.h"
#include "supervisor.h"

int main(int argc, char** argv) {
  distill::setIdentity(distill::Identity{-1, -1, distill::Role::kLauncher});
  try {
    auto args = distill::launcher::parseArgs(argc, argv);
    if (!args) return 0; // --help, --version
    distill::Config cfg = distill::loadConfig(args->config, args->overrides);
    distill::launcher::Supervisor supervisor(std::move(*args), std::move(cfg));
    return supervisor.run();
  } catch (const std::exception& e) {
    DISTILL_LOG(kError) << e.what();
    return 2;
  }
}
