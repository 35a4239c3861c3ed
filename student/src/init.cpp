#include "distill/student/init.h"

#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"

namespace distill {

Session init(int& argc, char** argv, const InitOptions& options) {
  exitOnUncaughtError();
  Session s;
  s.topology = Topology::fromEnvironment();
  setIdentity(s.topology.identity());
  s.config = jobConfig(argc, argv);
  s.topology.checkTeachers(s.config.teacher.procs);
  // The trainer's section, before anything waits on a peer: a problem there
  // ends this rank now, and distill-run tears the job down with its message.
  if (options.trainerKeys) s.config.trainer.expectOnly(*options.trainerKeys);
  if (options.validate) options.validate(s.config);
  if (s.topology.isTeacher()) {
    s.teacher = std::make_unique<TeacherContext>(s.topology, s.config);
    return s;
  }
  s.client = std::make_unique<Client>(s.topology, s.config); // admission first
  s.student = std::make_unique<StudentContext>(s.topology, s.config);
  return s;
}

} // namespace distill
