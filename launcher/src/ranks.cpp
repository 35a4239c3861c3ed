#include "ranks.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "distill/core/errors.h"

extern char** environ;

namespace distill::launcher {

std::string describeStatus(int st) {
  if (WIFEXITED(st)) return "exit code " + std::to_string(WEXITSTATUS(st));
  if (WIFSIGNALED(st)) {
    const char* abbrev = sigabbrev_np(WTERMSIG(st));
    return std::string("signal SIG") + (abbrev ? abbrev : std::to_string(WTERMSIG(st)).c_str()) + " (" +
        strsignal(WTERMSIG(st)) + ")";
  }
  return "status " + std::to_string(st);
}

bool failed(const Rank& r) {
  return r.exited && !r.endedAfterStudents && (!(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) || !r.exitProblem.empty());
}

std::string howItEnded(const Rank& r) {
  return r.prefix + describeStatus(r.status) + (r.exitProblem.empty() ? "" : " " + r.exitProblem);
}

namespace {

// This process's environment with r.env on top, as "K=V" strings.
std::vector<std::string> environmentOf(const Rank& r) {
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    if (!r.env.count(kv.substr(0, kv.find('=')))) envs.push_back(kv);
  }
  for (auto& [k, v] : r.env) envs.push_back(k + "=" + v);
  return envs;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// In the child, between fork and exec: async-signal-safe calls only.
[[noreturn]] void execRank(char** argv, char** env, int outFd, pid_t parent, const sigset_t& mask, int inheritFd) {
  if (inheritFd >= 0) ::fcntl(inheritFd, F_SETFD, 0); // survives the exec
  // Its own session, as torchrun gives each worker: a process group of its
  // own (a Ctrl-C at the terminal reaches the ranks through us only) and, where
  // the kernel groups by session (sched_autogroup), a scheduling group of its
  // own rather than a share of the caller's.
  ::setsid();
  // A peer's death must surface as an error naming it (EPIPE on a reset gloo
  // connection), not kill this rank too: SIG_IGN survives the exec.
  ::signal(SIGPIPE, SIG_IGN);
  // If distill-run is SIGKILLed, its ranks get SIGTERM rather than running on as orphans.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) ::_exit(126);
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
  ::dup2(outFd, STDOUT_FILENO);
  ::dup2(outFd, STDERR_FILENO);
  ::execvpe(argv[0], argv, env);
  std::fprintf(stderr, "distill-run: cannot exec %s: %s\n", argv[0], strerror(errno));
  ::_exit(127);
}

} // namespace

void spawn(Rank& r, const std::string& logDir, const sigset_t& childMask, int inheritFd) {
  int fds[2];
  DISTILL_CHECK_T(IpcError, ::pipe2(fds, O_CLOEXEC) == 0, "pipe2: ", errnoString(errno));
  Fd readEnd(fds[0]), writeEnd(fds[1]);
  if (!r.log.is_open()) // a restarted teacher goes on writing the same log
    r.log.open(logDir + "/rank_" + std::to_string(r.topo.globalRank) + ".log");
  std::vector<std::string> envs = environmentOf(r);
  std::vector<std::string> args = r.argv;
  std::vector<char*> cargv = pointers(args), cenv = pointers(envs);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  DISTILL_CHECK_T(IpcError, pid >= 0, "fork: ", errnoString(errno));
  if (pid == 0) execRank(cargv.data(), cenv.data(), writeEnd.get(), parent, childMask, inheritFd);
  // No setpgid(pid, pid) here: it would make the child a group leader before
  // its setsid(), which then fails. Until the child's setsid() ran, kill(-pid)
  // finds no group and signalRank falls back to the pid.
  ::fcntl(readEnd.get(), F_SETFL, O_NONBLOCK); // the console reads until EAGAIN; the rank's end stays blocking
  r.pid = pid;
  r.out = std::move(readEnd);
}

void signalRank(const Rank& r, int sig) {
  if (r.pid > 0 && !r.exited && ::kill(-r.pid, sig) != 0) ::kill(r.pid, sig);
}

Reaped reapOne() {
  Reaped out;
  const pid_t pid = retryEintr([&] { return ::waitpid(-1, &out.status, WNOHANG); });
  out.pid = pid > 0 ? pid : 0;
  return out;
}

} // namespace distill::launcher
