// distill-run: starts the local ranks of one node of a distill job.
//
//   distill-run [--nproc-per-node N] [--nnodes M --node-rank K --master-addr A
//               --master-port P] [--config F] [--set key=value]... [--log-dir D]
//               [--dry-run] [--stop-grace-s S] [--status-every-s S] -- TRAINER ARGS...
//
// Every option but --config, --set and --dry-run stands for a run.* config key
// (--nproc-per-node N is --set run.nproc_per_node=N, --log-dir D is
// run.log_dir, ...): validated by the config schema with the file, and handed
// to every rank with the --set ones in DISTILL_SET, so each rank runs the
// config checked here.
//
// Local ranks 0..N-2 run TRAINER as students; local rank N-1 runs the teacher
// (bin/distill-teacher, or TRAINER itself when teacher.kind is self). It owns
// the node's shared-memory segment: created before the first spawn, removed on
// every exit path. Every rank's output is prefixed on the console and kept
// whole in D/rank_<r>.log. A rank that fails tears the job down (SIGTERM, then
// SIGKILL after a grace period) with a summary naming it.
//
// Elastic teacher: a teacher that exits non-zero or is killed while students
// still run is started again, up to teacher.max_restarts times (its log
// continues in the same file; DISTILL_TEACHER_RESTART=n tells it which start
// it is). The segment tells the students a restart is coming, so they wait for
// it instead of failing; the new incarnation serves the requests left in the
// rings (see ipc/src/message.cpp). One more death tears the job down.
//
// SIGINT/SIGTERM: the first sets the segment's stop flag (students poll
// Client::stopRequested() to checkpoint and leave) and, if ranks are still
// running run.stop_grace_s later (--stop-grace-s, 10 s), forwards SIGTERM; a second signal
// forwards at once. distill-run then exits 128 + the signal number.
//
// Rendezvous (core/rendezvous.h): node 0 binds the student group's store
// socket to run.master_addr:run.master_port before anything starts (a port in
// use fails here; 0 picks a free one on a single node) and hands it to student
// rank 0 (DISTILL_STORE_FD). Students get the job secret in
// DISTILL_JOB_SECRET: made here for one node, taken from this process's
// environment (the same on every node) for several.
//
// Status: ranks print `DISTILL_STATUS step=.. loss=.. tokens_per_s=..` lines
// (kept in their logs, not echoed). On a terminal one live line shows the
// slowest student's step, the mean loss, the summed tokens/s and how busy the
// teacher is (its share of time in forward, published in the segment);
// otherwise a plain status line every run.status_every_s seconds and one at the
// end.
//
// Watchdog: when no process of the node begins or ends an event (flight
// recorder, ipc/hang_report.h) for run.hang_timeout_s, the hang table — every
// rank's state, current wait (on whom, for which tag, since when) or "busy in
// user code since", and its last 5 events — goes to the console and to
// <log_dir>/hang_report.txt; then per run.on_hang the job is torn down
// (teardown) or left running (wait). SIGUSR1 prints the same table at any
// time and changes nothing.
//
// Single-threaded: one poll() loop over the ranks' output pipes and a
// signalfd (SIGCHLD, SIGINT, SIGTERM, SIGUSR1), so no signal handler touches state.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iomanip>
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
#include "distill/core/rendezvous.h"
#include "distill/core/strings.h"
#include "distill/core/topology.h"
#include "distill/ipc/hang_report.h"
#include "distill/ipc/segment.h"

extern char** environ;

namespace distill {
namespace {

constexpr auto kGrace = std::chrono::seconds(5);  // SIGTERM -> SIGKILL
constexpr size_t kTailLines = 20;
constexpr auto kSampleEvery = std::chrono::milliseconds(100);  // status refresh
const std::string kStatusTag = "DISTILL_STATUS ";

struct Args {
  std::string config;
  // --set and the options that stand for a config key, in the order given
  // (later ones win). The launcher validates them with the file through the
  // config schema, and every rank gets them in DISTILL_SET, so that the ranks
  // run the config the launcher checked.
  std::vector<ConfigOverride> overrides;
  bool dryRun = false;
  std::vector<std::string> trainer;
};

// An option that stands for a config key: `--nproc-per-node N` is
// `--set run.nproc_per_node=N`, validated by the schema like the key (its
// range, its type), with the option named in a problem.
struct KeyOption {
  const char* flag;
  const char* key;
  bool text;  // a string key: the value is taken verbatim, not parsed as YAML
};
constexpr KeyOption kKeyOptions[] = {
    {"--nproc-per-node", "run.nproc_per_node", false},
    {"--nnodes", "run.nnodes", false},
    {"--node-rank", "run.node_rank", false},
    {"--master-addr", "run.master_addr", true},
    {"--master-port", "run.master_port", false},
    {"--log-dir", "run.log_dir", true},
    {"--stop-grace-s", "run.stop_grace_s", false},
    {"--status-every-s", "run.status_every_s", false},
};

[[noreturn]] void usage(const std::string& why) {
  DISTILL_THROW(ConfigError, why,
                "\nusage: distill-run [--nproc-per-node N] [--nnodes M --node-rank K "
                "--master-addr A --master-port P] --config F [--set key=value]... "
                "[--log-dir D] [--dry-run] [--stop-grace-s S] [--status-every-s S] -- TRAINER ARGS...\n"
                "each option but --config, --set and --dry-run stands for a run.* key of the config "
                "(--nproc-per-node N is --set run.nproc_per_node=N); later ones win");
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
    const KeyOption* option = nullptr;
    for (const KeyOption& o : kKeyOptions) {
      if (f == o.flag) option = &o;
    }
    if (option) {
      const std::string v = value(f);
      a.overrides.push_back({option->text ? stringOverride(option->key, v) : option->key + ("=" + v), f});
    } else if (f == "--config") {
      a.config = value(f);
    } else if (f == "--set") {
      a.overrides.push_back({value(f), "--set"});
    } else if (f == "--dry-run") {
      a.dryRun = true;
    } else {
      usage("unknown option '" + f + "'");
    }
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
  std::string at;
  if (const int err = makeDirs(dir, &at)) DISTILL_THROW(ConfigError, "run.log_dir: cannot create '", at, "': ", errnoString(err));
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
  std::map<std::string, double> reported;  // its last DISTILL_STATUS values
  std::vector<std::string> deaths;  // teacher: how each restarted incarnation ended
  // When things happened to it (monotonicNs, 0 = never): for the summary's
  // "who failed first", which is not always who exited first.
  int64_t exitedNs = 0;     // reaped
  int64_t termSentNs = 0;   // the teardown's SIGTERM
  int64_t killSentNs = 0;   // the teardown's SIGKILL
  int64_t stoppedSinceNs = 0;  // stopped (SIGSTOP) when the teardown began: its last heartbeat
  std::string exitProblem;  // exit code 0 that is still a failure (never attached, left attached)
};

// "DISTILL_STATUS step=3 loss=0.5" anywhere in a line -> {step: 3, loss: 0.5}; false if none.
bool parseStatus(const std::string& line, std::map<std::string, double>& out) {
  size_t at = line.find(kStatusTag);
  if (at == std::string::npos) return false;
  std::istringstream in(line.substr(at + kStatusTag.size()));
  std::string kv;
  while (in >> kv) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    char* end = nullptr;
    double v = std::strtod(kv.c_str() + eq + 1, &end);
    if (end != kv.c_str() + eq + 1) out[kv.substr(0, eq)] = v;
  }
  return true;
}

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
  return r.exited && (!(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) || !r.exitProblem.empty());
}

// "[r1 student] exit code 3", or for an exit 0 that is a failure "[r1 student]
// exit code 0 without attaching to the segment (...)".
std::string howItEnded(const Rank& r) {
  return r.prefix + describeStatus(r.status) + (r.exitProblem.empty() ? "" : " " + r.exitProblem);
}

class Launcher {
 public:
  Launcher(Args args, Config cfg) : a_(std::move(args)), cfg_(std::move(cfg)) {}

  int run() {
    // Every option reached the config (Args::overrides): the ranks' layout is
    // the validated config's, in ranges the schema states.
    const RunOptions& run = cfg_.run;
    const int nproc = run.nproc_per_node;
    const int nnodes = run.nnodes;
    const int node = run.node_rank;
    const std::string jobId = randomId();
    const std::string segment = "distill-" + jobId + "-n" + std::to_string(node);
    const std::string logDir = run.log_dir;
    // One override per line: the config refused control characters in them.
    std::string sets;
    for (auto& o : a_.overrides) sets += o.setting + "\n";

    for (int local = 0; local < nproc; ++local) {
      Rank r;
      Topology& t = r.topo;
      t = Topology::forLocalRank(node, nnodes, local, nproc);
      t.masterAddr = run.master_addr;
      t.masterPort = run.master_port;
      t.segment = segment;
      t.jobId = jobId;
      t.configPath = absolute(a_.config);
      r.env = topologyEnv(t);
      r.env["DISTILL_CONFIG"] = t.configPath;
      if (!sets.empty()) r.env["DISTILL_SET"] = sets;
      bool selfTeacher = t.isTeacher() && cfg_.teacher.kind == TeacherKind::kSelf;
      r.argv = t.isStudent() || selfTeacher ? a_.trainer
                                            : std::vector<std::string>{exeDir() + "/distill-teacher"};
      r.prefix = "[r" + std::to_string(t.globalRank) + " " + roleName(t.role) + "] ";
      r.ownPrefix = "[n" + std::to_string(node) + " r" + std::to_string(t.globalRank) + " ";
      ranks_.push_back(std::move(r));
    }

    rendezvousEnv(nnodes);

    if (a_.dryRun) {
      std::printf("distill-run plan: node %d/%d, %d processes, segment /dev/shm/%s, logs %s\n", node,
                  nnodes, nproc, segment.c_str(), logDir.c_str());
      for (auto& r : ranks_) {
        std::printf("%s%s:", r.prefix.c_str(), r.topo.describe().c_str());
        for (auto& x : r.argv) std::printf(" %s", x.c_str());
        std::printf("\n");
        for (auto& [k, v] : r.env)
          std::printf("    %s=%s\n", k.c_str(), k == kJobSecretEnv ? "(hidden)" : v.c_str());
      }
      return 0;
    }

    if (node == 0) bindStore();  // before anything starts: a port in use fails here, at once
    mkdirs(logDir);
    blockSignals();
    // A distill-run that was SIGKILLed could not remove its segment: the next run does.
    for (auto& stale : ipc::Segment::removeStale("distill-"))
      DISTILL_LOG(kWarning) << "removed stale segment /dev/shm/" << stale << ": its distill-run is gone";
    seg_ = ipc::Segment::create(segment, ipc::SegmentLayout::fromOptions(cfg_.transport, nproc - 1), jobId);
    segmentName_ = segment;
    node_ = node;
    seg_->setTeacherMaxRestarts(cfg_.teacher.max_restarts);
    logDir_ = logDir;
    DISTILL_LOG(kInfo) << "job " << jobId << ": " << nproc - 1 << " student(s) + 1 teacher on node "
                       << node << "/" << nnodes << ", segment /dev/shm/" << segment << ", logs in " << logDir;
    tty_ = ::isatty(STDOUT_FILENO) == 1;
    nextStatus_ = Deadline::afterSeconds(cfg_.run.status_every_s);
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

  ~Launcher() {
    removeSegment();
    if (storeFd_ >= 0) ::close(storeFd_);
  }

 private:
  // The student group's rendezvous (core/rendezvous.h): every student gets
  // the job secret; a free port (run.master_port 0) only for one node, whose
  // launcher chooses it (bindStore).
  void rendezvousEnv(int nnodes) {
    const char* given = std::getenv(kJobSecretEnv);
    std::string secret = given ? given : "";
    if (secret.empty()) {
      DISTILL_CHECK_T(ConfigError, nnodes == 1, "a job of ", nnodes, " nodes needs one secret on every node for its "
                      "rendezvous store: set ", kJobSecretEnv, " to the same value in each distill-run's "
                      "environment (e.g. from `openssl rand -hex 32`)");
      secret = makeJobSecret();
    }
    DISTILL_CHECK_T(ConfigError, secret.size() >= 16, kJobSecretEnv, " has ", secret.size(),
                    " characters; a job secret needs at least 16 (e.g. `openssl rand -hex 32`)");
    for (auto& r : ranks_) {
      DISTILL_CHECK_T(ConfigError, r.topo.masterPort > 0 || nnodes == 1, "run.master_port 0 (a free port) is for "
                      "single-node jobs: the other nodes could not know the port chosen; give --master-port");
      if (r.topo.isStudent()) r.env[kJobSecretEnv] = secret;
    }
  }

  // Node 0: binds the store's socket to run.master_addr (a free port for 0)
  // and hands it to student rank 0, which serves the store on it; the ranks
  // learn the port in MASTER_PORT.
  void bindStore() {
    Rank* host = nullptr;
    for (auto& r : ranks_)
      if (r.topo.studentRank == 0) host = &r;
    if (!host) return;
    const int asked = host->topo.masterPort;
    StoreListener l = listenForStore(host->topo.masterAddr, asked);
    storeFd_ = l.fd;
    storeRank_ = host;
    for (auto& r : ranks_) {
      r.topo.masterPort = l.port;
      r.env["MASTER_PORT"] = std::to_string(l.port);
    }
    host->env[kStoreFdEnv] = std::to_string(l.fd);
    DISTILL_LOG(kInfo) << "rendezvous store on " << l.address << ":" << l.port << " (served by student rank 0"
                       << (asked == 0 ? "; a free port" : "") << ")";
  }

  void blockSignals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGUSR1);
    ::sigprocmask(SIG_BLOCK, &set, &oldMask_);
    sigfd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    DISTILL_CHECK_T(IpcError, sigfd_ >= 0, "signalfd: ", errnoString(errno));
  }

  void start(Rank& r, const std::string& logDir) {
    int fds[2];
    DISTILL_CHECK_T(IpcError, ::pipe2(fds, O_CLOEXEC) == 0, "pipe2: ", errnoString(errno));
    if (!r.log.is_open())  // a restarted teacher goes on writing the same log
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
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    DISTILL_CHECK_T(IpcError, pid >= 0, "fork: ", errnoString(errno));
    const int inherit = &r == storeRank_ ? storeFd_ : -1;  // the store's socket, for student rank 0 only
    if (pid == 0) {
      if (inherit >= 0) ::fcntl(inherit, F_SETFD, 0);  // survives the exec
      ::setpgid(0, 0);  // its own group: a Ctrl-C reaches the ranks through us only
      // If distill-run is SIGKILLed, its ranks get SIGTERM rather than running on as orphans.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(126);
      ::sigprocmask(SIG_SETMASK, &oldMask_, nullptr);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::execvpe(cargv[0], cargv.data(), cenv.data());
      std::fprintf(stderr, "distill-run: cannot exec %s: %s\n", cargv[0], strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so that kill(-pid) cannot race the child's own call
    ::close(fds[1]);
    if (inherit >= 0) {  // it is student rank 0's now: the port is free again when that rank ends
      ::close(storeFd_);
      storeFd_ = -1;
    }
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);  // pump() reads until EAGAIN; the rank's end stays blocking
    r.pid = pid;
    r.out = fds[0];
  }

  // Signals a rank's process group (the rank and anything it started).
  static void signalRank(const Rank& r, int sig) {
    if (r.pid > 0 && !r.exited && ::kill(-r.pid, sig) != 0) ::kill(r.pid, sig);
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
    if (parseStatus(line, r.reported)) {
      statusSeen_ = true;
      return;  // shown as the status line, kept in the log only
    }
    std::string out = (line.rfind(r.ownPrefix, 0) == 0 ? "" : r.prefix) + line + "\n";
    console(out);
    r.tail.push_back(line);
    if (r.tail.size() > kTailLines) r.tail.pop_front();
  }

  // Writes to the console; on a terminal the live status line stays the last line.
  void console(const std::string& text) {
    if (tty_ && liveShown_) (void)!::write(STDOUT_FILENO, "\r\033[K", 4);
    (void)!::write(STDOUT_FILENO, text.data(), text.size());
    liveShown_ = false;
  }

  // "step=12 loss=0.53 tokens/s=12000 teacher busy=43%": the slowest student's
  // step, mean loss, summed tokens/s over the students that reported.
  std::string statusText() const {
    double step = -1, loss = 0, tps = 0;
    int nLoss = 0, nTps = 0;
    for (auto& r : ranks_) {
      auto get = [&](const char* k, double& v) {
        auto it = r.reported.find(k);
        return it != r.reported.end() && (v = it->second, true);
      };
      double v;
      if (get("step", v)) step = step < 0 ? v : std::min(step, v);
      if (get("loss", v)) loss += v, ++nLoss;
      if (get("tokens_per_s", v)) tps += v, ++nTps;
    }
    std::ostringstream os;
    os << std::setprecision(4);
    if (step >= 0) os << "step=" << static_cast<int64_t>(step) << " ";
    if (nLoss) os << "loss=" << loss / nLoss << " ";
    if (nTps) os << "tokens/s=" << static_cast<int64_t>(tps) << " ";
    if (teacherAttached_) os << "teacher busy=" << static_cast<int>(100 * seg_->teacherBusy() + 0.5) << "% ";
    std::string text = os.str();
    return text.empty() ? "no status yet" : text.substr(0, text.size() - 1);
  }

  // Shows the status: the live line (redrawn when it changes) or a periodic plain line.
  void tick() {
    if (!seg_ || nextSample_.when() > Clock::now()) return;
    nextSample_ = Deadline::after(kSampleEvery);
    watchdog();
    if (!statusSeen_) return;
    if (!teacherAttached_) {
      for (auto& p : seg_->processes()) teacherAttached_ |= p.role == "teacher" && p.pid != 0;
    }
    if (tty_) {
      std::string line = "\r\033[K[distill-run] " + statusText();
      if (liveShown_ && line == live_) return;
      (void)!::write(STDOUT_FILENO, line.data(), line.size());
      live_ = line;
      liveShown_ = true;
    } else if (nextStatus_.expired()) {
      printStatus();
    }
  }

  void printStatus() {
    console("[distill-run] status: " + statusText() + "\n");
    nextStatus_ = Deadline::afterSeconds(cfg_.run.status_every_s);
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
          r.exitedNs = monotonicNs();
          r.exitProblem = exitZeroProblem(r);
          if (r.out >= 0) pump(r, true);
          if (liveShown_) console("");
          logLine(failed(r) ? LogLevel::kError : LogLevel::kInfo,
                  r.prefix + "exited: " + describeStatus(st) + (r.exitProblem.empty() ? "" : " " + r.exitProblem));
        }
      }
    }
  }

  // An exit code 0 is a failure when the rank never attached to the segment
  // (a trainer that returned before distill::init: the teacher would wait the
  // whole run.startup_timeout_s for it) or left without detaching (its peers
  // would wait on it): the reason, or "" when it detached cleanly. Before any
  // rank failed or a stop was asked only; after that, leaving is what it should do.
  std::string exitZeroProblem(const Rank& r) const {
    if (!seg_ || !WIFEXITED(r.status) || WEXITSTATUS(r.status) != 0 || teardownDeadline_ || stopSignal_) return "";
    const auto procs = seg_->processes();
    const int local = r.topo.localRank;
    if (local >= static_cast<int>(procs.size())) return "";
    const auto& p = procs[size_t(local)];
    if (p.pid == 0)
      return "without attaching to the segment (it never called distill::init, or returned before it; "
             "the other ranks would have waited run.startup_timeout_s for it)";
    if (p.pid == r.pid && p.state != "finished")
      return "without detaching from the segment (state " + p.state + ": it left its peers waiting)";
    return "";
  }

  bool allExited() const {
    for (auto& r : ranks_) {
      if (!r.exited) return false;
    }
    return true;
  }

  void onSignal(int sig) {
    const std::string name = strsignal(sig);
    if (!stopSignal_) {
      stopSignal_ = sig;
      if (reason_.empty()) reason_ = "received " + name;
      seg_->requestStop();
      stopDeadline_ = Deadline::afterSeconds(cfg_.run.stop_grace_s);
      DISTILL_LOG(kWarning) << name << ": asked the ranks to stop; SIGTERM follows in " << cfg_.run.stop_grace_s
                            << " s if they have not exited (again to stop now)";
    } else {
      teardown("received " + name + " twice");
    }
  }

  // Runs until every rank exited; a failed rank or a signal tears the job down.
  int loop() {
    for (;;) {
      std::vector<pollfd> fds{{sigfd_, POLLIN, 0}};
      std::vector<Rank*> owners{nullptr};
      for (auto& r : ranks_) {
        if (r.out >= 0) {
          fds.push_back({r.out, POLLIN, 0});
          owners.push_back(&r);
        }
      }
      Deadline wake = nextSample_;
      if (teardownDeadline_) wake = wake.min(*teardownDeadline_);
      if (stopDeadline_) wake = wake.min(*stopDeadline_);
      // Round up: waking a little late is fine, waking early spins.
      int timeoutMs = static_cast<int>(std::chrono::ceil<Millis>(wake.remaining()).count());
      int n = ::poll(fds.data(), fds.size(), timeoutMs);
      if (n < 0 && errno != EINTR) DISTILL_THROW(IpcError, "poll: ", errnoString(errno));
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents) pump(*owners[i], false);
      }
      if (fds[0].revents & POLLIN) {
        signalfd_siginfo si{};
        while (::read(sigfd_, &si, sizeof si) == sizeof si) {
          if (si.ssi_signo == SIGINT || si.ssi_signo == SIGTERM) onSignal(static_cast<int>(si.ssi_signo));
          if (si.ssi_signo == SIGUSR1) reportHang("hang table (SIGUSR1): node " + std::to_string(node_) + ", segment /dev/shm/" + segmentName_);
        }
        reap();
      }
      for (auto& r : ranks_) {
        if (failed(r) && r.exitProblem.empty() && r.topo.isTeacher() && mayRestartTeacher()) restartTeacher(r);
        if (failed(r) && !failedRank_ && !teardownDeadline_) {
          if (reason_.empty()) reason_ = howItEnded(r);
          failedRank_ = &r;
          teardown(howItEnded(r));
        }
      }
      if (allExited()) break;
      if (stopDeadline_ && stopDeadline_->expired() && !teardownDeadline_)
        teardown("still running " + detail::str(cfg_.run.stop_grace_s) + " s after the stop request");
      if (teardownDeadline_ && teardownDeadline_->expired() && !killed_) {
        DISTILL_LOG(kError) << "ranks still running " << toMs(kGrace) << " ms after SIGTERM: SIGKILL";
        for (auto& r : ranks_) {
          if (!r.exited) r.killSentNs = monotonicNs();
          signalRank(r, SIGKILL);
        }
        killed_ = true;
      }
      tick();
    }
    for (auto& r : ranks_) {
      if (r.out >= 0) pump(r, true);
    }
    if (statusSeen_) printStatus();
    if (reason_.empty()) {
      DISTILL_LOG(kInfo) << "job finished: every rank exited 0" << restartsText();
      return 0;
    }
    summary();
    return stopSignal_ ? 128 + stopSignal_ : 1;
  }

  // A dead teacher is restarted while restarts are left, students still run and
  // the job is neither stopping nor being torn down.
  bool mayRestartTeacher() const {
    if (teardownDeadline_ || stopSignal_ || seg_->teacherRestarts() >= cfg_.teacher.max_restarts) return false;
    for (auto& r : ranks_) {
      if (r.topo.isStudent() && !r.exited) return true;
    }
    return false;
  }

  void restartTeacher(Rank& r) {
    const std::string how = describeStatus(r.status);
    r.deaths.push_back(how);
    const int n = seg_->noteTeacherRestart(r.pid);  // before the spawn: students keep waiting, not failing
    logLine(LogLevel::kWarning, r.prefix + "died (" + how + "); restarting it (" + std::to_string(n) + " of " +
                                    std::to_string(cfg_.teacher.max_restarts) + " restarts)");
    r.log << "==== distill-run: restart " << n << " of " << cfg_.teacher.max_restarts << " after " << how << " ====\n";
    r.exited = false;
    r.status = 0;
    r.pid = -1;
    r.env["DISTILL_TEACHER_RESTART"] = std::to_string(n);
    start(r, logDir_);
  }

  // "signal SIGKILL (Killed); exit code 3": how each restarted teacher ended.
  std::string deathsText() const {
    std::string how;
    for (auto& r : ranks_) {
      for (auto& d : r.deaths) how += (how.empty() ? "" : "; ") + d;
    }
    return how;
  }

  // ", teacher restarted 1 of 2 times (signal SIGKILL (Killed))" or "".
  std::string restartsText() const {
    const int n = seg_ ? seg_->teacherRestarts() : 0;
    if (n == 0) return "";
    return ", teacher restarted " + std::to_string(n) + " of " + std::to_string(cfg_.teacher.max_restarts) +
           " times (" + deathsText() + ")";
  }

  // Progress is any event begun or ended by any process (its flight recorder),
  // an attach, a clean detach or a rank's exit; heartbeats are not. No
  // progress for run.hang_timeout_s is a hang: the table, then per
  // run.on_hang a teardown or another period of waiting.
  void watchdog() {
    uint64_t progress = ipc::progressCount(*seg_);
    for (auto& r : ranks_) progress += r.exited ? 1 : 0;
    const auto now = Clock::now();
    if (progress != lastProgress_) {
      lastProgress_ = progress;
      lastProgressAt_ = now;
      return;
    }
    const auto idle = now - lastProgressAt_;
    if (teardownDeadline_ || idle < std::chrono::duration<double>(cfg_.run.hang_timeout_s)) return;
    char title[200];
    std::snprintf(title, sizeof title, "hang: no rank made progress for %.1f s (run.hang_timeout_s=%g, on_hang=%s)",
                  std::chrono::duration<double>(idle).count(), cfg_.run.hang_timeout_s, toString(cfg_.run.on_hang));
    reportHang(title);
    if (cfg_.run.on_hang == OnHang::kTeardown) {
      hung_ = true;
      if (reason_.empty()) reason_ = title;
      teardown(title);
    } else {
      logLine(LogLevel::kWarning, "on_hang=wait: the job keeps running; the next report after another " +
                                      std::to_string(static_cast<int64_t>(cfg_.run.hang_timeout_s)) + " s without progress");
      lastProgressAt_ = now;
    }
  }

  // Prints the hang table (every process: state, current wait or activity,
  // last events) to the console and appends it to <log_dir>/hang_report.txt.
  void reportHang(const std::string& title) {
    if (!seg_) return;
    std::map<int, std::string> notes;
    const auto procs = seg_->processes();
    for (auto& r : ranks_) {
      const int local = r.topo.localRank;
      if (r.exited) {
        notes[local] = "exited: " + describeStatus(r.status);
      } else if (local < static_cast<int>(procs.size()) && procs[size_t(local)].pid != r.pid) {
        notes[local] = "pid " + std::to_string(r.pid) + " running, never attached (global rank " +
                       std::to_string(r.topo.globalRank) + ")";
      }
    }
    const std::string table = ipc::formatHangTable(*seg_, title, notes);
    if (liveShown_) console("");
    console(table);
    std::ofstream f(logDir_ + "/hang_report.txt", std::ios::app);
    f << table << "\n";
  }

  void teardown(const std::string& why) {
    if (teardownDeadline_) return;
    DISTILL_LOG(kError) << "tearing the job down: " << why;
    teardownStartNs_ = monotonicNs();
    // Before anything moves: which ranks are stopped (SIGSTOP) and since when
    // (their last heartbeat), for the summary's "who failed first".
    if (seg_) {
      const auto procs = seg_->processes();
      for (auto& r : ranks_) {
        const size_t local = size_t(r.topo.localRank);
        if (r.exited || r.pid <= 0 || !ipc::processStopped(r.pid)) continue;
        r.stoppedSinceNs = local < procs.size() && procs[local].pid == r.pid && procs[local].heartbeatNs > 0
                               ? procs[local].heartbeatNs
                               : teardownStartNs_;
      }
    }
    if (seg_) seg_->abort();  // every wait on the segment fails now
    for (auto& r : ranks_) {
      if (!r.exited) r.termSentNs = monotonicNs();
      signalRank(r, SIGTERM);
      signalRank(r, SIGCONT);  // a stopped rank (SIGSTOP) acts on the SIGTERM now, not at the SIGKILL
    }
    teardownDeadline_ = Deadline::after(kGrace);
  }

  // The rank that failed first and how, as the summary's headline. The rank
  // whose exit distill-run noticed first is not always it: a student that
  // detached abnormally (an exception) may take seconds to exit while the
  // teacher, seeing it gone, exits at once; a stopped student never exits by
  // itself while the teacher gives up on it. So each rank's failure is dated
  // by what the segment recorded: when it detached abnormally (endedNs), its
  // last heartbeat when it was stopped or died attached (a lower bound of the
  // death), else when it was reaped. Ranks that ended by the teardown's own
  // signals did not cause it and are not dated.
  struct FirstFailure {
    const Rank* rank = nullptr;
    std::string how;
    int64_t atNs = 0;
  };
  FirstFailure firstFailure() const {
    FirstFailure best;
    const auto procs = seg_ ? seg_->processes() : std::vector<ipc::ProcessSnapshot>{};
    for (auto& r : ranks_) {
      const size_t local = size_t(r.topo.localRank);
      const ipc::ProcessSnapshot* p = local < procs.size() && procs[local].pid == r.pid ? &procs[local] : nullptr;
      const std::string ended = r.exited ? describeStatus(r.status) : "still running";
      FirstFailure f;
      if (p && p->state == "dead" && p->endedNs > 0 && (!teardownStartNs_ || p->endedNs <= teardownStartNs_)) {
        f = {&r, r.prefix + "detached abnormally from the segment (then " + ended + ")", p->endedNs};
      } else if (r.stoppedSinceNs) {
        f = {&r, r.prefix + "was stopped (SIGSTOP) (then " + ended + ")", r.stoppedSinceNs};
      } else if (failed(r)) {
        const int sig = WIFSIGNALED(r.status) ? WTERMSIG(r.status) : 0;
        const bool ours = (sig == SIGTERM && r.termSentNs) || (sig == SIGKILL && r.killSentNs);
        if (ours) continue;
        int64_t at = r.exitedNs;
        // Died while attached: its last heartbeat is a lower bound of the death.
        if (p && p->state != "finished" && p->state != "dead" && p->heartbeatNs > 0) at = std::min(at, p->heartbeatNs);
        f = {&r, howItEnded(r), at};
      } else {
        continue;
      }
      if (!best.rank || f.atNs < best.atNs) best = f;
    }
    return best;
  }

  void summary() {
    std::ostringstream os;
    const Rank* tail = failedRank_;
    std::string headline = reason_;
    if (failedRank_ && !hung_) {
      const FirstFailure first = firstFailure();
      if (first.rank) {
        headline = first.how;
        tail = first.rank;
        if (first.rank != failedRank_)
          headline += "; distill-run noticed " + howItEnded(*failedRank_) + " first";
      }
    }
    os << "\n==== distill-run: job " << (failedRank_ || hung_ ? "failed" : "stopped") << ": " << headline << "\n";
    for (auto& r : ranks_) {
      os << "  " << (r.exited ? howItEnded(r) : r.prefix + "still running");
      auto step = r.reported.find("step");
      if (step != r.reported.end()) os << ", last step " << static_cast<int64_t>(step->second);
      os << "\n";
    }
    if (cfg_.teacher.max_restarts > 0)
      os << "  teacher restarts: " << (seg_ ? seg_->teacherRestarts() : 0) << " of " << cfg_.teacher.max_restarts
         << (deathsText().empty() ? "" : " (" + deathsText() + ")") << "\n";
    if (tail) {
      os << "  last lines of " << tail->prefix.substr(0, tail->prefix.size() - 1) << ":\n";
      for (auto& l : tail->tail) os << "    | " << l << "\n";
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
  std::optional<ipc::Segment> seg_;
  std::string segmentName_;
  std::string logDir_;
  int storeFd_ = -1;           // node 0: the store's listening socket until student rank 0 has it
  Rank* storeRank_ = nullptr;  // the rank that serves the store
  int sigfd_ = -1;
  sigset_t oldMask_{};
  std::string reason_;                  // why the job did not end normally ("" = it did)
  int stopSignal_ = 0;                  // first SIGINT/SIGTERM received
  std::optional<Deadline> stopDeadline_;
  std::optional<Deadline> teardownDeadline_;
  int64_t teardownStartNs_ = 0;         // monotonicNs() when the teardown began
  bool killed_ = false;
  Rank* failedRank_ = nullptr;
  // Watchdog.
  bool hung_ = false;                   // torn down for a hang
  uint64_t lastProgress_ = ~uint64_t(0);
  Clock::time_point lastProgressAt_ = Clock::now();
  int node_ = 0;
  // Status line.
  bool tty_ = false, liveShown_ = false, statusSeen_ = false;
  std::string live_;  // the live line on the terminal
  Deadline nextSample_ = Deadline::after(kSampleEvery);
  Deadline nextStatus_ = Deadline::never();
  bool teacherAttached_ = false;  // from then on its busy share (published by serve()) is shown
};

}  // namespace
}  // namespace distill

int main(int argc, char** argv) {
  distill::setIdentity(distill::Identity{-1, -1, distill::Role::kLauncher});
  try {
    distill::Args args = distill::parseArgs(argc, argv);
    distill::Config cfg = distill::loadConfig(args.config, args.overrides);
    distill::Launcher launcher(std::move(args), std::move(cfg));
    return launcher.run();
  } catch (const std::exception& e) {
    DISTILL_LOG(kError) << e.what();
    return 2;
  }
}
