#include "distill/student/init.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/ipc/torchrun.h"

namespace distill {
namespace {

bool executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

// distill-teacher, for a trainer that torchrun started in the teacher's slot:
// $DISTILL_TEACHER_BIN, next to the trainer, the install's bin directory, the
// build's, then PATH.
std::string teacherBinary() {
  if (const char* env = std::getenv("DISTILL_TEACHER_BIN"); env && *env) return env;
  std::vector<std::string> candidates;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    const std::string exe(self, size_t(n));
    candidates.push_back(exe.substr(0, exe.rfind('/')) + "/distill-teacher");
  }
  candidates.push_back(std::string(DISTILL_INSTALL_BIN_DIR) + "/distill-teacher");
  candidates.push_back(std::string(DISTILL_BUILD_BIN_DIR) + "/distill-teacher");
  for (auto& c : candidates) {
    if (executable(c)) return c;
  }
  return "distill-teacher"; // execvp searches PATH
}

// Under torchrun the teacher's slot runs the trainer binary; with a teacher
// that is not the trainer itself (teacher.kind torchscript or registered) it
// becomes distill-teacher, with the same arguments (distill-teacher reads
// --config and --set from them and ignores the rest) and environment.
[[noreturn]] void becomeTeacherServer(const std::vector<std::string>& args) {
  const std::string bin = teacherBinary();
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(bin.c_str()));
  for (size_t i = 1; i < args.size(); ++i) argv.push_back(const_cast<char*>(args[i].c_str()));
  argv.push_back(nullptr);
  DISTILL_LOG(kInfo) << "torchrun: local rank in the teacher's slot runs " << bin;
  ::execvp(argv[0], argv.data());
  DISTILL_THROW(ConfigError, "torchrun: cannot run the teacher server ", bin, ": ", errnoString(errno),
                " (set DISTILL_TEACHER_BIN to distill-teacher's path)");
}

} // namespace

Session init(int& argc, char** argv, const InitOptions& options) {
  exitOnUncaughtError();
  // A peer's death must surface as a PeerLostError naming it, not kill this
  // rank with SIGPIPE on the peer's reset gloo socket (distill-run sets the
  // same before its exec; torchrun does not).
  ::signal(SIGPIPE, SIG_IGN);
  const std::vector<std::string> args(argv, argv + argc); // before jobConfig takes its options out
  Session s;
  s.topology = Topology::fromEnvironment();
  setIdentity(s.topology.identity());
  s.config = jobConfig(argc, argv);
  s.topology.checkTeachers(s.config.teacher.procs);
  // The trainer's section, before anything waits on a peer: a problem there
  // ends this rank now, and distill-run tears the job down with its message.
  if (options.trainerKeys) s.config.trainer.expectOnly(*options.trainerKeys);
  if (options.validate) options.validate(s.config);
  if (s.topology.isTeacher() && s.topology.torchrun && s.config.teacher.kind != TeacherKind::kSelf)
    becomeTeacherServer(args);
  ipc::joinTorchrunSegment(s.topology, s.config); // torchrun: the node's segment, made by whoever comes first
  if (s.topology.isTeacher()) {
    s.teacher = std::make_unique<TeacherContext>(s.topology, s.config);
    return s;
  }
  s.client = std::make_unique<Client>(s.topology, s.config); // admission first
  s.student = std::make_unique<StudentContext>(s.topology, s.config);
  return s;
}

} // namespace distill
