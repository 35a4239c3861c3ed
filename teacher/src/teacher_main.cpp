// distill-teacher's main: the teacher server of a job, as distill-run (or
// torchrun, through distill::init) starts it.
#include <signal.h>

#include <ATen/Parallel.h>

#include <cstdio>
#include <cstring>

#include "distill/core/config.h"
#include "distill/core/logging.h"
#include "distill/core/topology.h"
#include "distill/core/version.h"
#include "distill/ipc/torchrun.h"
#include "distill/teacher/model.h"
#include "distill/teacher/server.h"

namespace distill {

int teacherMain(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN); // a student's death is a PeerLostError, never a SIGPIPE here
  // Only as the one argument: under torchrun this program gets the trainer's arguments, which may
  // hold a --version of the trainer's own.
  if (argc == 2 && std::strcmp(argv[1], "--version") == 0) {
    std::printf("distill-teacher %s\n", version());
    return 0;
  }
  try {
    Topology topo = Topology::fromEnvironment();
    setIdentity(topo.identity());
    Config config = jobConfig(argc, argv);
    topo.checkTeachers(config.teacher.procs);
    ipc::joinTorchrunSegment(topo, config); // torchrun: the node's segment, made by whoever comes first
    TeacherContext ctx(topo, config);
    if (config.teacher.threads > 0) at::set_num_threads(config.teacher.threads);
    // A teacher of a pool runs on its own device (teacher.devices); the
    // config itself stays as written: admission compares it with the students'.
    TeacherOptions mine = config.teacher;
    mine.device = teacherDevice(config.teacher, topo.teacherIndex);
    auto model = loadTeacherModel(mine);
    serve(ctx, model);
    return 0;
  } catch (const std::exception& e) {
    DISTILL_LOG(kError) << e.what();
    return 1;
  }
}

} // namespace distill
