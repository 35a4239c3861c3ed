#include "distill/core/context.h"

#include "distill/core/errors.h"
#include "distill/core/logging.h"

namespace distill {

TeacherContext::TeacherContext(Topology topo, Config config) : topo_(std::move(topo)), config_(std::move(config)) {
  DISTILL_CHECK_T(ConfigError, topo_.isTeacher(), "a TeacherContext needs the teacher's topology, got ",
                  topo_.describe());
  setIdentity(topo_.identity());
}

} // namespace distill
