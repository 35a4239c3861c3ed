#include "distill/group/student_context.h"

#include <ATen/Context.h>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/group/student_group.h"

namespace distill {

StudentContext::StudentContext(Topology topo, Config config) : topo_(std::move(topo)), config_(std::move(config)) {
  DISTILL_CHECK_T(ConfigError, topo_.isStudent(), "a StudentContext needs a student's topology, got ",
                  topo_.describe());
  setIdentity(topo_.identity());
  // Every student starts from the same RNG state, so that a model built after
  // distill::init has the same initial weights on every student (and
  // broadcastParameters, student/grad.h, makes sure of it as DDP does).
  at::manual_seed(static_cast<uint64_t>(config_.run.seed));
  group_.reset(new StudentGroup(topo_, config_.run, config_.student));
}

StudentContext::~StudentContext() = default;

} // namespace distill
