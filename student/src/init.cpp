#include "distill/student/init.h"

#include "distill/core/config.h"
#include "distill/core/logging.h"

namespace distill {

Session init(int& argc, char** argv) {
  Session s;
  s.topology = Topology::fromEnvironment();
  setIdentity(s.topology.identity());
  s.config = jobConfig(argc, argv);
  if (s.topology.isTeacher()) {
    s.teacher = std::make_unique<TeacherContext>(s.topology, s.config);
    return s;
  }
  s.client = std::make_unique<Client>(s.topology, s.config);  // admission first
  s.student = std::make_unique<StudentContext>(s.topology, s.config);
  return s;
}

}  // namespace distill
