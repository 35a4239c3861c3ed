#include "mps.h"

#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/sys.h"

extern char** environ;

namespace distill::launcher {
namespace {

constexpr const char* kProgram = "nvidia-cuda-mps-control";
constexpr auto kStartLimit = std::chrono::seconds(30);
constexpr auto kQuitLimit = std::chrono::seconds(15);

// `name`'s path on PATH (as execvp would find it), or "".
std::string onPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string p = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

std::string tail(const std::string& file) {
  std::ifstream in(file);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.size() > 2000 ? "..." + s.substr(s.size() - 2000) : s;
}

// Runs `program arg` with `input` on its stdin and its output appended to `logFile`, with an empty
// signal mask (distill-run blocks the signals it reads from a signalfd), within `limit`: its exit
// status (waitpid's), or -1 when it was killed at the deadline, -2 when it could not start.
int runBounded(const std::string& program, const std::string& arg, const std::string& input,
               const std::string& logFile, std::chrono::milliseconds limit) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return -2;
  Fd readEnd(fds[0]), writeEnd(fds[1]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, readEnd.get(), 0);
  posix_spawn_file_actions_addopen(&fa, 1, logFile.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> argv{const_cast<char*>(program.c_str())};
  if (!arg.empty()) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, program.c_str(), &fa, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  readEnd.reset();
  if (rc != 0) return -2;
  // What it reads: written at once (a few bytes fit any pipe), then EOF.
  if (!input.empty()) (void)retryEintr([&] { return ::write(writeEnd.get(), input.data(), input.size()); });
  writeEnd.reset();
  // The deadline is kept by poll() on a pidfd: readable when the process has exited. (A kernel
  // without pidfd_open, before Linux 5.3, waits for the exit without a deadline.)
  Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (pidfd.valid()) {
    pollfd p{pidfd.get(), POLLIN, 0};
    const int ready = retryEintr([&] { return ::poll(&p, 1, static_cast<int>(limit.count())); });
    if (ready == 0) ::kill(pid, SIGKILL);
  }
  int status = 0;
  (void)retryEintr([&] { return ::waitpid(pid, &status, 0); });
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) return -1;
  return status;
}

// Removes the server's folder and what it holds (its sockets, its logs); best effort.
void removeTree(const std::string& dir) {
  ::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, FTW*) { return ::remove(path), 0; }, 16,
      FTW_DEPTH | FTW_PHYS);
}

std::string describe(int status) {
  if (status == -1) return "did not finish within its limit and was killed";
  if (status == -2) return "could not be started";
  if (WIFEXITED(status)) return "exited " + std::to_string(WEXITSTATUS(status));
  return "was ended by signal " + std::to_string(WTERMSIG(status));
}

} // namespace

MpsServer::MpsServer(const Config& cfg, const std::string& jobId) {
  if (cfg.transport.cuda_mps != CudaMps::kOn) return;
  if (const char* given = std::getenv("CUDA_MPS_PIPE_DIRECTORY"); given && *given) {
    DISTILL_LOG(kInfo) << "transport.cuda_mps: on: CUDA_MPS_PIPE_DIRECTORY is set (" << given
                       << "): the ranks use that MPS server; distill-run starts none";
    return;
  }
  program_ = onPath(kProgram);
  DISTILL_CHECK_T(ConfigError, !program_.empty(), "transport.cuda_mps: on needs ", kProgram,
                  " (the NVIDIA driver's MPS control program) on PATH, and it is not there: install the driver's "
                  "utilities, or set transport.cuda_mps: off");
  // Under /tmp: the server's socket path must stay short (108 bytes), which a log folder may not.
  const std::string dir = "/tmp/distill-mps-" + jobId;
  for (const std::string& d : {dir, dir + "/pipe", dir + "/log"}) {
    DISTILL_CHECK_T(ConfigError, ::mkdir(d.c_str(), 0700) == 0, "transport.cuda_mps: cannot create '", d,
                    "': ", errnoString(errno));
  }
  dir_ = dir;
  ::setenv("CUDA_MPS_PIPE_DIRECTORY", (dir + "/pipe").c_str(), 1); // the ranks inherit both
  ::setenv("CUDA_MPS_LOG_DIRECTORY", (dir + "/log").c_str(), 1);
  const int st = runBounded(program_, "-d", "", dir + "/control.log", kStartLimit);
  if (st != 0) { // no server to stop: its folder and variables go
    const std::string out = tail(dir + "/control.log");
    dir_.clear();
    removeTree(dir);
    ::unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    ::unsetenv("CUDA_MPS_LOG_DIRECTORY");
    DISTILL_THROW(ConfigError, "transport.cuda_mps: on: `", program_, " -d` ", describe(st),
                  out.empty() ? std::string() : ": " + out, " (set transport.cuda_mps: off to run without MPS)");
  }
  DISTILL_LOG(kInfo) << "transport.cuda_mps: an MPS server for this node's ranks (" << program_
                     << " -d; CUDA_MPS_PIPE_DIRECTORY=" << dir << "/pipe)";
}

MpsServer::~MpsServer() { stop(); }

void MpsServer::stop() {
  if (dir_.empty()) return;
  const std::string dir = std::move(dir_);
  dir_.clear();
  const int st = runBounded(program_, "", "quit\n", dir + "/control.log", kQuitLimit);
  if (st != 0) {
    DISTILL_LOG(kWarning) << "transport.cuda_mps: `quit` to " << program_ << " " << describe(st)
                       << "; the MPS server of CUDA_MPS_PIPE_DIRECTORY=" << dir << "/pipe may still run ("
                       << tail(dir + "/control.log") << ")";
    return; // its folder stays: the server's socket and logs are in it
  }
  removeTree(dir);
  DISTILL_LOG(kInfo) << "transport.cuda_mps: the MPS server stopped";
}

} // namespace distill::launcher
