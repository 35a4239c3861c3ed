// distill-run: starts the local ranks of one node of a distill job.
//
//   distill-run [--nproc-per-node N] [--nnodes M --node-rank K --master-addr A
//               --master-port P] [--config F] [--set key=value]... [--log-dir D]
//               [--dry-run] -- TRAINER ARGS...
//
// Local ranks 0..N-2 run TRAINER as students; local rank N-1 runs the teacher
// (bin/distill-teacher, or TRAINER itself when teacher.kind is self). It owns
// the node's shared-memory segment: created before the first spawn, removed on
// every exit path. Every rank's output is prefixed on the console and kept
// whole in D/rank_<r>.log. A rank that fails tears the job down (SIGTERM, then
// SIGKILL after a grace period) with a summary naming it. SIGINT/SIGTERM are
// forwarded to every rank.
//
// Single-threaded: one poll() loop over the ranks' output pipes and a
// signalfd (SIGCHLD, SIGINT, SIGTERM), so no signal handler touches state.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/topology.h"
#include "distill/ipc/segment.h"

extern char** environ;

namespace distill {
namespace {

constexpr auto kGrace = std::chrono::seconds(5);  // SIGTERM -> SIGKILL
constexpr size_t kTailLines = 20;

struct Args {
  int nproc = -1, nnodes = -1, nodeRank = -1, masterPort = -1;
  std::string masterAddr, config, logDir;
  std::vector<std::string> sets;
  bool dryRun = false;
  std::vector<std::string> trainer;
};

[[noreturn]] void usage(const std::string& why) {
  DISTILL_THROW(ConfigError, why,
                "\nusage: distill-run [--nproc-per-node N] [--nnodes M --node-rank K "
                "--master-addr A --master-port P] [--config F] [--set key=value]... "
                "[--log-dir D] [--dry-run] -- TRAINER ARGS...");
}

int toInt(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 0 || x > INT_MAX) usage(flag + ": not a number: '" + v + "'");
  return static_cast<int>(x);
}

Args parseArgs(int argc, char** argv) {
  Args a;
  int i = 1;
  auto value = [&](const std::string& flag) -> std::string {
    if (i + 1 >= argc) usage(flag + " needs a value");
    return argv[++i];
  };
  for (; i < argc; ++i) {
    std::string f = argv[i];
    if (f == "--") {
      for (++i; i < argc; ++i) a.trainer.push_back(argv[i]);
      break;
    }
    if (f == "--nproc-per-node") a.nproc = toInt(f, value(f));
    else if (f == "--nnodes") a.nnodes = toInt(f, value(f));
    else if (f == "--node-rank") a.nodeRank = toInt(f, value(f));
    else if (f == "--master-addr") a.masterAddr = value(f);
    else if (f == "--master-port") a.masterPort = toInt(f, value(f));
    else if (f == "--config") a.config = value(f);
    else if (f == "--set") a.sets.push_back(value(f));
    else if (f == "--log-dir") a.logDir = value(f);
    else if (f == "--dry-run") a.dryRun = true;
    else usage("unknown option '" + f + "'");
  }
  if (a.trainer.empty()) usage("no trainer command after --");
  if (a.config.empty()) usage("--config is required");
  return a;
}

std::string randomId() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << rd() << rd();
  return os.str().substr(0, 12);
}

std::string absolute(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

std::string exeDir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  std::string s(buf);
  return s.substr(0, s.rfind('/'));
}

void mkdirs(const std::string& dir) {
  std::string cur;
  std::stringstream ss(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      DISTILL_THROW(ConfigError, "run.log_dir: cannot create '", cur, "': ", errnoString(errno));
    }
  }
}

struct Rank {
  Topology topo;
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  pid_t pid = -1;
  int out = -1;  // read end of its stdout+stderr
  std::string partial;
  std::deque<std::string> tail;
  std::ofstream log;
  bool exited = false;
  int status = 0;
  std::string prefix;    // "[r3 student] " on the console
  std::string ownPrefix; // "[n0 r3 " : lines distill already prefixed get no second prefix
};

std::string describeStatus(int st) {
  if (WIFEXITED(st)) return "exit code " + std::to_string(WEXITSTATUS(st));
  if (WIFSIGNALED(st)) return std::string("signal ") + strsignal(WTERMSIG(st));
  return "status " + std::to_string(st);
}

bool failed(const Rank& r) { return r.exited && !(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0); }

class Launcher {
 public:
  Launcher(Args args, Config cfg) : a_(std::move(args)), cfg_(std::move(cfg)) {}

  int run() {
    const RunOptions& run = cfg_.run;
    const int nproc = a_.nproc >= 0 ? a_.nproc : run.nproc_per_node;
    const int nnodes = a_.nnodes >= 0 ? a_.nnodes : run.nnodes;
    const int node = a_.nodeRank >= 0 ? a_.nodeRank : run.node_rank;
    DISTILL_CHECK_T(ConfigError, nproc >= 2, "--nproc-per-node must be >= 2 (students + teacher), got ", nproc);
    DISTILL_CHECK_T(ConfigError, node < nnodes, "--node-rank ", node, " is not below --nnodes ", nnodes);
    const std::string jobId = randomId();
    const std::string segment = "distill-" + jobId + "-n" + std::to_string(node);
    const std::string logDir = a_.logDir.empty() ? run.log_dir : a_.logDir;
    std::string sets;
    for (auto& s : a_.sets) sets += s + "\n";

    for (int local = 0; local < nproc; ++local) {
      Rank r;
      Topology& t = r.topo;
      t.role = local == nproc - 1 ? Role::kTeacher : Role::kStudent;
      t.nodeRank = node;
      t.nnodes = nnodes;
      t.localRank = local;
      t.localWorldSize = nproc;
      t.globalRank = node * nproc + local;
      t.globalWorldSize = nnodes * nproc;
      t.studentWorldSize = nnodes * (nproc - 1);
      if (t.isStudent()) {
        t.studentRank = node * (nproc - 1) + local;
        t.studentLocalRank = local;
      }
      t.masterAddr = a_.masterAddr.empty() ? run.master_addr : a_.masterAddr;
      t.masterPort = a_.masterPort >= 0 ? a_.masterPort : run.master_port;
      t.segment = segment;
      t.jobId = jobId;
      t.configPath = absolute(a_.config);
      r.env = topologyEnv(t);
      r.env["DISTILL_CONFIG"] = t.configPath;
      if (!sets.empty()) r.env["DISTILL_SET"] = sets;
      bool selfTeacher = t.isTeacher() && cfg_.teacher.kind == "self";
      r.argv = t.isStudent() || selfTeacher ? a_.trainer
                                            : std::vector<std::string>{exeDir() + "/distill-teacher"};
      r.prefix = "[r" + std::to_string(t.globalRank) + " " + roleName(t.role) + "] ";
      r.ownPrefix = "[n" + std::to_string(node) + " r" + std::to_string(t.globalRank) + " ";
      ranks_.push_back(std::move(r));
    }

    if (a_.dryRun) {
      std::printf("distill-run plan: node %d/%d, %d processes, segment /dev/shm/%s, logs %s\n", node,
                  nnodes, nproc, segment.c_str(), logDir.c_str());
      for (auto& r : ranks_) {
        std::printf("%s%s:", r.prefix.c_str(), r.topo.describe().c_str());
        for (auto& x : r.argv) std::printf(" %s", x.c_str());
        std::printf("\n");
        for (auto& [k, v] : r.env) std::printf("    %s=%s\n", k.c_str(), v.c_str());
      }
      return 0;
    }

    mkdirs(logDir);
    blockSignals();
    auto seg = ipc::Segment::create(segment, ipc::SegmentLayout::fromOptions(cfg_.transport, nproc - 1), jobId);
    segmentName_ = segment;
    DISTILL_LOG(kInfo) << "job " << jobId << ": " << nproc - 1 << " student(s) + 1 teacher on node "
                       << node << "/" << nnodes << ", segment /dev/shm/" << segment << ", logs in " << logDir;
    int rc = 1;
    try {
      for (auto& r : ranks_) start(r, logDir);
      rc = loop();
    } catch (...) {
      teardown("launcher error");
      removeSegment();
      throw;
    }
    removeSegment();
    return rc;
  }

  ~Launcher() { removeSegment(); }

 private:
  void blockSignals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    ::sigprocmask(SIG_BLOCK, &set, &oldMask_);
    sigfd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    DISTILL_CHECK_T(IpcError, sigfd_ >= 0, "signalfd: ", errnoString(errno));
  }

  void start(Rank& r, const std::string& logDir) {
    int fds[2];
    DISTILL_CHECK_T(IpcError, ::pipe2(fds, O_CLOEXEC) == 0, "pipe2: ", errnoString(errno));
    r.log.open(logDir + "/rank_" + std::to_string(r.topo.globalRank) + ".log");
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      if (!r.env.count(kv.substr(0, kv.find('=')))) envs.push_back(kv);
    }
    for (auto& [k, v] : r.env) envs.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (auto& x : r.argv) cargv.push_back(const_cast<char*>(x.c_str()));
    cargv.push_back(nullptr);
    for (auto& x : envs) cenv.push_back(const_cast<char*>(x.c_str()));
    cenv.push_back(nullptr);
    pid_t pid = ::fork();
    DISTILL_CHECK_T(IpcError, pid >= 0, "fork: ", errnoString(errno));
    if (pid == 0) {
      ::setpgid(0, 0);  // its own group: a Ctrl-C reaches the ranks through us only
      ::sigprocmask(SIG_SETMASK, &oldMask_, nullptr);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::execvpe(cargv[0], cargv.data(), cenv.data());
      std::fprintf(stderr, "distill-run: cannot exec %s: %s\n", cargv[0], strerror(errno));
      ::_exit(127);
    }
    ::close(fds[1]);
    r.pid = pid;
    r.out = fds[0];
  }

  // Forwards a rank's output line by line: prefixed on the console, whole in its log.
  void pump(Rank& r, bool flush) {
    char buf[65536];
    for (;;) {
      ssize_t n = ::read(r.out, buf, sizeof buf);
      if (n > 0) {
        r.partial.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        ::close(r.out);
        r.out = -1;
        flush = true;
      }
      if (n < 0 && errno == EINTR) continue;
      break;
    }
    size_t pos;
    while ((pos = r.partial.find('\n')) != std::string::npos) {
      emit(r, r.partial.substr(0, pos));
      r.partial.erase(0, pos + 1);
    }
    if (flush && !r.partial.empty()) {
      emit(r, r.partial);
      r.partial.clear();
    }
  }

  void emit(Rank& r, const std::string& line) {
    r.log << line << '\n';
    r.log.flush();
    std::string out = (line.rfind(r.ownPrefix, 0) == 0 ? "" : r.prefix) + line + "\n";
    (void)!::write(STDOUT_FILENO, out.data(), out.size());
    r.tail.push_back(line);
    if (r.tail.size() > kTailLines) r.tail.pop_front();
  }

  void reap() {
    for (;;) {
      int st = 0;
      pid_t pid = ::waitpid(-1, &st, WNOHANG);
      if (pid <= 0) return;
      for (auto& r : ranks_) {
        if (r.pid == pid) {
          r.exited = true;
          r.status = st;
          if (r.out >= 0) pump(r, true);
          logLine(failed(r) ? LogLevel::kError : LogLevel::kInfo, r.prefix + "exited: " + describeStatus(st));
        }
      }
    }
  }

  bool allExited() const {
    for (auto& r : ranks_) {
      if (!r.exited) return false;
    }
    return true;
  }

  // Runs until every rank exited; a failed rank or a signal tears the job down.
  int loop() {
    std::string reason;
    for (;;) {
      std::vector<pollfd> fds{{sigfd_, POLLIN, 0}};
      std::vector<Rank*> owners{nullptr};
      for (auto& r : ranks_) {
        if (r.out >= 0) {
          fds.push_back({r.out, POLLIN, 0});
          owners.push_back(&r);
        }
      }
      int timeoutMs = -1;
      if (teardownDeadline_) timeoutMs = static_cast<int>(std::max<int64_t>(0, toMs(teardownDeadline_->remaining())));
      int n = ::poll(fds.data(), fds.size(), timeoutMs);
      if (n < 0 && errno != EINTR) DISTILL_THROW(IpcError, "poll: ", errnoString(errno));
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents) pump(*owners[i], false);
      }
      if (fds[0].revents & POLLIN) {
        signalfd_siginfo si{};
        while (::read(sigfd_, &si, sizeof si) == sizeof si) {
          if (si.ssi_signo == SIGINT || si.ssi_signo == SIGTERM) {
            DISTILL_LOG(kWarning) << strsignal(static_cast<int>(si.ssi_signo)) << ": stopping the job";
            if (reason.empty()) reason = std::string("received ") + strsignal(static_cast<int>(si.ssi_signo));
            teardown(reason);
          }
        }
        reap();
      }
      for (auto& r : ranks_) {
        if (failed(r) && reason.empty()) {
          reason = r.prefix + describeStatus(r.status);
          failedRank_ = &r;
          teardown(reason);
        }
      }
      if (allExited()) break;
      if (teardownDeadline_ && teardownDeadline_->expired() && !killed_) {
        for (auto& r : ranks_) {
          if (!r.exited) ::kill(r.pid, SIGKILL);
        }
        killed_ = true;
      }
    }
    for (auto& r : ranks_) {
      if (r.out >= 0) pump(r, true);
    }
    if (reason.empty()) {
      DISTILL_LOG(kInfo) << "job finished: every rank exited 0";
      return 0;
    }
    summary(reason);
    return 1;
  }

  void teardown(const std::string& why) {
    if (teardownDeadline_) return;
    DISTILL_LOG(kError) << "tearing the job down: " << why;
    for (auto& r : ranks_) {
      if (r.pid > 0 && !r.exited) ::kill(r.pid, SIGTERM);
    }
    teardownDeadline_ = Deadline::after(kGrace);
  }

  void summary(const std::string& reason) {
    std::ostringstream os;
    os << "\n==== distill-run: job failed: " << reason << "\n";
    for (auto& r : ranks_) {
      os << "  " << r.prefix << (r.exited ? describeStatus(r.status) : "still running") << "\n";
    }
    if (failedRank_) {
      os << "  last lines of " << failedRank_->prefix << ":\n";
      for (auto& l : failedRank_->tail) os << "    | " << l << "\n";
    }
    std::string s = os.str();
    (void)!::write(STDERR_FILENO, s.data(), s.size());
  }

  void removeSegment() {
    if (!segmentName_.empty()) {
      ipc::Segment::remove(segmentName_);
      segmentName_.clear();
    }
  }

  Args a_;
  Config cfg_;
  std::vector<Rank> ranks_;
  std::string segmentName_;
  int sigfd_ = -1;
  sigset_t oldMask_{};
  std::optional<Deadline> teardownDeadline_;
  bool killed_ = false;
  Rank* failedRank_ = nullptr;
};

}  // namespace
}  // namespace distill

int main(int argc, char** argv) {
  distill::setIdentity(distill::Identity{-1, -1, distill::Role::kLauncher});
  try {
    distill::Args args = distill::parseArgs(argc, argv);
    distill::Config cfg = distill::loadConfig(args.config, args.sets);
    distill::Launcher launcher(std::move(args), std::move(cfg));
    return launcher.run();
  } catch (const std::exception& e) {
    DISTILL_LOG(kError) << e.what();
    return 2;
  }
}
