#include "distill/student/init.h"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/ipc/torchrun.h"

namespace distill {
namespace {

bool executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

// The folder of the loaded distill library that holds this code (dladdr), "" if unknown.
std::string libraryDir() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(&libraryDir), &info) == 0 || !info.dli_fname) return "";
  char real[PATH_MAX];
  const std::string lib = ::realpath(info.dli_fname, real) ? real : info.dli_fname;
  const size_t slash = lib.rfind('/');
  return slash == std::string::npos ? "" : lib.substr(0, slash);
}

// distill-teacher, for a trainer that torchrun started in the teacher's slot,
// and where it came from (for the log): $DISTILL_TEACHER_BIN; the programs of
// the distill whose library is loaded (the install's bin folder, found from
// the library's folder as the install layout puts it, DISTILL_LIB_TO_BIN: also
// the build tree's lib/ and bin/, and pip's distill/lib and distill/bin); then
// PATH. Never a folder named at configure time: an install moved or made with
// another --prefix finds its own programs.
std::pair<std::string, std::string> teacherBinary() {
  if (const char* env = std::getenv("DISTILL_TEACHER_BIN"); env && *env) return {env, "$DISTILL_TEACHER_BIN"};
  if (const std::string dir = libraryDir(); !dir.empty()) {
    for (const char* rel : {DISTILL_LIB_TO_BIN, "../bin"}) {
      const std::string c = dir + "/" + rel + "/distill-teacher";
      if (!executable(c)) continue;
      char real[PATH_MAX];
      return {::realpath(c.c_str(), real) ? std::string(real) : c, "beside the loaded distill library " + dir};
    }
  }
  if (const char* path = std::getenv("PATH")) {
    std::string all = path;
    for (size_t start = 0; start <= all.size();) {
      const size_t colon = all.find(':', start);
      const std::string dir = all.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
      const std::string c = (dir.empty() ? "." : dir) + "/distill-teacher";
      if (executable(c)) return {c, "from PATH"};
      if (colon == std::string::npos) break;
      start = colon + 1;
    }
  }
  return {"distill-teacher", "not found beside the loaded distill library nor on PATH"};
}

// Under torchrun the teacher's slot runs the trainer binary; with a teacher
// that is not the trainer itself (teacher.kind torchscript or registered) it
// becomes distill-teacher, with the same arguments (distill-teacher reads
// --config and --set from them and ignores the rest) and environment.
[[noreturn]] void becomeTeacherServer(const std::vector<std::string>& args) {
  const auto [bin, from] = teacherBinary();
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(bin.c_str()));
  for (size_t i = 1; i < args.size(); ++i) argv.push_back(const_cast<char*>(args[i].c_str()));
  argv.push_back(nullptr);
  DISTILL_LOG(kInfo) << "torchrun: local rank in the teacher's slot runs " << bin << " (" << from << ")";
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
