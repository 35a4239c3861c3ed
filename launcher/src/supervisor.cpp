#include "supervisor.h"

#include <poll.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/payload.h"
#include "distill/group/rendezvous.h"
#include "distill/ipc/hang_report.h"
#include "summary.h"

namespace distill::launcher {
namespace {

constexpr auto kGrace = std::chrono::seconds(5); // SIGTERM -> SIGKILL

std::string randomId() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << rd() << rd();
  return os.str().substr(0, 12);
}

} // namespace

Supervisor::Supervisor(Args args, Config cfg)
    : a_(std::move(args)),
      cfg_(std::move(cfg)),
      console_(::isatty(STDOUT_FILENO) == 1, cfg_.run.status_every_s),
      watchdog_(cfg_.run.hang_timeout_s, cfg_.run.on_hang),
      nextSample_(Deadline::after(kSampleEvery)) {}

Supervisor::~Supervisor() { removeSegment(); }

int Supervisor::run() {
  // Every option reached the config (Args::overrides): the ranks' layout is
  // the validated config's, in ranges the schema states.
  const RunOptions& run = cfg_.run;
  node_ = run.node_rank;
  // The ring slots the config needs (core/payload.h): a size set below them is
  // an error now, before any rank starts, and the sizes are said once.
  checkSlotBytes(cfg_);
  DISTILL_LOG(kInfo) << describeSlotBytes(cfg_);
  const std::string jobId = randomId();
  const std::string segment = "distill-" + jobId + "-n" + std::to_string(node_);
  layOut(segment, jobId);
  rendezvousEnv(run.nnodes);
  if (a_.dryRun) return printPlan(segment);

  mps_.emplace(cfg_, jobId); // before any socket or segment exists: the server inherits none of them
  if (node_ == 0) bindStore(); // before anything starts: a port in use fails here, at once
  std::string at;
  if (const int err = makeDirs(run.log_dir, &at, {}, dirModeBits(run.file_mode)))
    DISTILL_THROW(ConfigError, "run.log_dir: cannot create '", at, "': ", errnoString(err));
  blockSignals();
  createSegment(segment, jobId);
  int rc = 1;
  try {
    for (auto& r : ranks_) start(r);
    rc = loop();
  } catch (...) {
    teardown("launcher error");
    removeSegment();
    throw;
  }
  removeSegment();
  mps_.reset(); // every rank has exited: the server's clients are gone
  return rc;
}

// The student group's rendezvous (group/rendezvous.h): every student gets
// the job secret; a free port (run.master_port 0) only for one node, whose
// launcher chooses it (bindStore).
void Supervisor::rendezvousEnv(int nnodes) {
  const char* given = std::getenv(kJobSecretEnv);
  std::string secret = given ? given : "";
  if (secret.empty()) {
    DISTILL_CHECK_T(ConfigError, nnodes == 1, "a job of ", nnodes,
                    " nodes needs one secret on every node for its "
                    "rendezvous store: set ",
                    kJobSecretEnv,
                    " to the same value in each distill-run's "
                    "environment (e.g. from `openssl rand -hex 32`)");
    secret = makeJobSecret();
  }
  DISTILL_CHECK_T(ConfigError, secret.size() >= 16, kJobSecretEnv, " has ", secret.size(),
                  " characters; a job secret needs at least 16 (e.g. `openssl rand -hex 32`)");
  for (auto& r : ranks_) {
    DISTILL_CHECK_T(ConfigError, r.topo.masterPort > 0 || nnodes == 1,
                    "run.master_port 0 (a free port) is for "
                    "single-node jobs: the other nodes could not know the port chosen; give --master-port");
    if (r.topo.isStudent()) r.env[kJobSecretEnv] = secret;
  }
}

// Node 0: binds the store's socket to run.master_addr (a free port for 0)
// and hands it to student rank 0, which serves the store on it; the ranks
// learn the port in MASTER_PORT.
void Supervisor::bindStore() {
  Rank* host = nullptr;
  for (auto& r : ranks_)
    if (r.topo.studentRank == 0) host = &r;
  if (!host) return;
  const int asked = host->topo.masterPort;
  StoreListener l = listenForStore(host->topo.masterAddr, asked);
  storeFd_.reset(l.fd);
  storeRank_ = host;
  for (auto& r : ranks_) {
    r.topo.masterPort = l.port;
    r.env["MASTER_PORT"] = std::to_string(l.port);
  }
  host->env[kStoreFdEnv] = std::to_string(l.fd);
  DISTILL_LOG(kInfo) << "rendezvous store on " << l.address << ":" << l.port << " (served by student rank 0"
                     << (asked == 0 ? "; a free port" : "") << ")";
}

void Supervisor::blockSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);
  ::sigprocmask(SIG_BLOCK, &set, &oldMask_);
  sigfd_.reset(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  DISTILL_CHECK_T(IpcError, sigfd_.valid(), "signalfd: ", errnoString(errno));
}

// A log file of run.log_dir made (or kept) with run.file_mode's permissions
// before it is opened for writing; a failure is left to that open to report.
void Supervisor::privateLog(const std::string& name) const {
  createWithMode(cfg_.run.log_dir + "/" + name, fileModeBits(cfg_.run.file_mode));
}

void Supervisor::start(Rank& r) {
  const int inherit = &r == storeRank_ ? storeFd_.get() : -1; // the store's socket, for student rank 0 only
  if (!r.log.is_open()) privateLog("rank_" + std::to_string(r.topo.globalRank) + ".log");
  spawn(r, cfg_.run.log_dir, oldMask_, inherit);
  // It is student rank 0's now: the port is free again when that rank ends.
  if (inherit >= 0) storeFd_.reset();
}

// Runs until every rank exited; a failed rank or a signal tears the job down.
int Supervisor::loop() {
  while (!allExited()) {
    pollOnce();
    checkRanks();
    if (allExited()) break;
    checkDeadlines();
    afterStudents();
    tick();
  }
  return finish();
}

// One poll() over the signalfd and the ranks' output, until the next sample
// or deadline: forwards output, handles signals, reaps.
void Supervisor::pollOnce() {
  std::vector<pollfd> fds{{sigfd_.get(), POLLIN, 0}};
  std::vector<Rank*> owners{nullptr};
  for (auto& r : ranks_) {
    if (r.out.valid()) {
      fds.push_back({r.out.get(), POLLIN, 0});
      owners.push_back(&r);
    }
  }
  Deadline wake = nextSample_;
  if (teardownDeadline_) wake = wake.min(*teardownDeadline_);
  if (stopDeadline_) wake = wake.min(*stopDeadline_);
  // Round up: waking a little late is fine, waking early spins. Signals come
  // through the signalfd, so an EINTR (distill-run stopped and continued) only
  // means "poll again".
  const int timeoutMs = static_cast<int>(std::chrono::ceil<Millis>(wake.remaining()).count());
  const int n = retryEintr([&] { return ::poll(fds.data(), fds.size(), timeoutMs); });
  if (n < 0) DISTILL_THROW(IpcError, "poll: ", errnoString(errno));
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents) console_.pump(*owners[i], false);
  }
  if (fds[0].revents & POLLIN) {
    readSignals();
    reap();
  }
}

void Supervisor::readSignals() {
  signalfd_siginfo si{};
  while (retryEintr([&] { return ::read(sigfd_.get(), &si, sizeof si); }) == sizeof si) {
    if (si.ssi_signo == SIGINT || si.ssi_signo == SIGTERM) onSignal(static_cast<int>(si.ssi_signo));
    if (si.ssi_signo == SIGUSR1 && seg_)
      reportHang(hangTable(
          *seg_, ranks_, "hang table (SIGUSR1): node " + std::to_string(node_) + ", segment /dev/shm/" + segmentName_));
  }
}

void Supervisor::onSignal(int sig) {
  const std::string name = strsignal(sig);
  if (stopSignal_) {
    teardown("received " + name + " twice");
    return;
  }
  stopSignal_ = sig;
  if (reason_.empty()) reason_ = "received " + name;
  seg_->requestStop();
  stopDeadline_ = Deadline::afterSeconds(cfg_.run.stop_grace_s);
  DISTILL_LOG(kWarning) << name << ": asked the ranks to stop; SIGTERM follows in " << cfg_.run.stop_grace_s
                        << " s if they have not exited (again to stop now)";
}

void Supervisor::reap() {
  for (Reaped c = reapOne(); c.pid > 0; c = reapOne()) {
    for (auto& r : ranks_) {
      if (r.pid == c.pid) onExit(r, c.status);
    }
  }
}

void Supervisor::onExit(Rank& r, int status) {
  r.exited = true;
  r.status = status;
  r.exitedNs = monotonicNs();
  r.exitProblem = exitZeroProblem(r);
  if (r.out.valid()) console_.pump(r, true);
  console_.leaveLiveLine();
  logLine(failed(r) ? LogLevel::kError : LogLevel::kInfo,
          r.prefix + "exited: " + describeStatus(status) + (r.exitProblem.empty() ? "" : " " + r.exitProblem));
}

// A failed teacher may be restarted; any other failure tears the job down.
void Supervisor::checkRanks() {
  for (auto& r : ranks_) {
    if (failed(r) && r.exitProblem.empty() && r.topo.isTeacher() && mayRestartTeacher(r)) restartTeacher(r);
    if (failed(r) && !failedRank_ && !teardownDeadline_) {
      if (reason_.empty()) reason_ = howItEnded(r);
      failedRank_ = &r;
      teardown(howItEnded(r));
    }
  }
}

// The stop request's grace and the teardown's grace.
void Supervisor::checkDeadlines() {
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
}

// After the last rank exited: its last output, the last status line, the summary.
int Supervisor::finish() {
  for (auto& r : ranks_) {
    if (r.out.valid()) console_.pump(r, true);
  }
  const int restarts = seg_ ? seg_->teacherRestarts() : 0;
  if (seg_ && readStatuses()) console_.printStatus(status());
  if (const std::string v = balance_.verdict(nodeShape(cfg_), cacheNote(true)); !v.empty()) {
    DISTILL_LOG(kInfo) << "balance: " << v;
  }
  if (reason_.empty()) {
    DISTILL_LOG(kInfo) << "job finished: every rank exited 0"
                       << restartsText(ranks_, restarts, cfg_.teacher.max_restarts);
    return 0;
  }
  const Ending e{reason_, failedRank_, hung_, teardownStartNs_, restarts, cfg_.teacher.max_restarts};
  const std::string s = summaryText(ranks_, seg_ ? &*seg_ : nullptr, e);
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = retryEintr([&] { return ::write(STDERR_FILENO, s.data() + done, s.size() - done); });
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  return stopSignal_ ? 128 + stopSignal_ : 1;
}

// An exit code 0 is a failure when the rank never attached to the segment
// (a trainer that returned before distill::init: the teacher would wait the
// whole run.startup_timeout_s for it) or left without detaching (its peers
// would wait on it): the reason, or "" when it detached cleanly. Before any
// rank failed or a stop was asked only; after that, leaving is what it should do.
std::string Supervisor::exitZeroProblem(const Rank& r) const {
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

bool Supervisor::allExited() const {
  for (auto& r : ranks_) {
    if (!r.exited) return false;
  }
  return true;
}

// A dead teacher is restarted while it has restarts left (teacher.max_restarts
// each), one of the students it serves still runs and the job is neither
// stopping nor being torn down. The other teachers and their students carry on.
bool Supervisor::mayRestartTeacher(const Rank& teacher) const {
  if (teardownDeadline_ || stopSignal_ || seg_->teacherRestarts(teacher.topo.teacherIndex) >= cfg_.teacher.max_restarts)
    return false;
  if (seg_->teacherGaveUp(teacher.topo.teacherIndex)) return false; // failed again on the same request
  for (auto& r : ranks_) {
    if (r.topo.isStudent() && !r.exited && r.topo.teacherLocalRankOf(r.topo.studentLocalRank) == teacher.topo.localRank)
      return true;
  }
  return false;
}

void Supervisor::restartTeacher(Rank& r) {
  const std::string how = describeStatus(r.status);
  r.deaths.push_back(how);
  // Before the spawn: its students keep waiting, not failing.
  const int n = seg_->noteTeacherRestart(r.topo.teacherIndex, r.pid);
  const std::string of = std::to_string(cfg_.teacher.max_restarts);
  logLine(LogLevel::kWarning,
          r.prefix + "died (" + how + "); restarting it (" + std::to_string(n) + " of " + of + " restarts)");
  r.log << "==== distill-run: restart " << n << " of " << of << " after " << how << " ====\n";
  r.exited = false;
  r.status = 0;
  r.pid = -1;
  r.env["DISTILL_TEACHER_RESTART"] = std::to_string(n);
  start(r);
}

// The hang table to the console and appended to <log_dir>/hang_report.txt.
void Supervisor::reportHang(const std::string& table) {
  console_.leaveLiveLine();
  console_.write(table);
  privateLog("hang_report.txt");
  std::ofstream f(cfg_.run.log_dir + "/hang_report.txt", std::ios::app);
  f << table << "\n";
}

// A hang: the table, then per run.on_hang a teardown or another period of waiting.
void Supervisor::onVerdict(const Verdict& v) {
  if (!v.hang) return;
  reportHang(v.table);
  if (cfg_.run.on_hang == OnHang::kTeardown) {
    hung_ = true;
    if (reason_.empty()) reason_ = v.title;
    teardown(v.title);
  } else {
    logLine(LogLevel::kWarning,
            "on_hang=wait: the job keeps running; the next report after another " +
                std::to_string(static_cast<int64_t>(cfg_.run.hang_timeout_s)) + " s without progress");
  }
}

void Supervisor::teardown(const std::string& why) {
  if (teardownDeadline_) return;
  DISTILL_LOG(kError) << "tearing the job down: " << why;
  teardownStartNs_ = monotonicNs();
  noteStoppedRanks();
  if (seg_) seg_->abort(); // every wait on the segment fails now
  for (auto& r : ranks_) {
    if (!r.exited) r.termSentNs = monotonicNs();
    signalRank(r, SIGTERM);
    signalRank(r, SIGCONT); // a stopped rank (SIGSTOP) acts on the SIGTERM now, not at the SIGKILL
  }
  teardownDeadline_ = Deadline::after(kGrace);
}

// Before the teardown moves anything: which ranks are stopped (SIGSTOP) and
// since when (their last heartbeat), for the summary's "who failed first".
void Supervisor::noteStoppedRanks() {
  if (!seg_) return;
  const auto procs = seg_->processes();
  for (auto& r : ranks_) {
    const size_t local = size_t(r.topo.localRank);
    if (r.exited || r.pid <= 0 || !ipc::processStopped(r.pid)) continue;
    r.stoppedSinceNs = local < procs.size() && procs[local].pid == r.pid && procs[local].heartbeatNs > 0
        ? procs[local].heartbeatNs
        : teardownStartNs_;
  }
}

// Once every student of the node exited 0 the job's work is done: a teacher
// still running (stopped by a scheduler just after the last step, say) is
// continued, given run.stop_grace_s to finish, then ended — and the job still
// counts as finished, because nothing of it was lost.
void Supervisor::afterStudents() {
  if (teardownDeadline_ || stopSignal_ || !reason_.empty()) return;
  if (!studentsDoneDeadline_) {
    for (auto& r : ranks_) {
      if (r.topo.isStudent() && (!r.exited || failed(r))) return;
    }
    studentsDoneDeadline_ = Deadline::afterSeconds(cfg_.run.stop_grace_s);
    for (auto& r : ranks_) {
      if (r.exited || r.pid <= 0 || !ipc::processStopped(r.pid)) continue;
      logLine(LogLevel::kWarning, r.prefix + "is stopped (SIGSTOP) after every student finished: SIGCONT, so it can end");
      signalRank(r, SIGCONT);
    }
    return;
  }
  if (!studentsDoneDeadline_->expired() || killed_) return;
  for (auto& r : ranks_) {
    if (r.exited) continue;
    logLine(LogLevel::kWarning, r.prefix + "still running " + detail::str(cfg_.run.stop_grace_s) +
                                    " s after every student finished: SIGKILL (the students' work is complete)");
    r.endedAfterStudents = true;
    signalRank(r, SIGCONT);
    signalRank(r, SIGKILL);
  }
  killed_ = true;
}

void Supervisor::removeSegment() {
  if (!segmentName_.empty()) {
    ipc::Segment::remove(segmentName_);
    segmentName_.clear();
  }
}

} // namespace distill::launcher
