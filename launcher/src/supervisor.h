#pragma once

// The supervisor: distill-run's one loop. It lays the node's ranks out,
// creates the segment, starts the ranks and then polls their output pipes and
// a signalfd (SIGCHLD, SIGINT, SIGTERM, SIGUSR1), so no signal handler touches
// state. It acts on what it sees:
//
// - A rank that fails tears the job down (the segment's abort flag, SIGTERM,
//   SIGKILL after a grace period) with a summary naming the rank that failed
//   first (summary.h).
// - Teacher pool: the last teacher.procs local ranks are teachers; local
//   student i is served by teacher i % teacher.procs (--dry-run prints who serves whom).
// - Elastic teacher: a teacher that exits non-zero or is killed while its students
//   still run is started again, up to teacher.max_restarts times each (its log
//   continues in the same file; DISTILL_TEACHER_RESTART=n tells it which start
//   it is). The segment tells the students a restart is coming, so they wait
//   for it instead of failing; the new incarnation serves the requests left in
//   the rings (the replay of ipc/src/replay.h). One more death tears the job down.
// - SIGINT/SIGTERM: the first sets the segment's stop flag (students poll
//   Client::stopRequested() to checkpoint and leave) and, if ranks are still
//   running run.stop_grace_s later (--stop-grace-s), forwards SIGTERM; a second
//   signal forwards at once. distill-run then exits 128 + the signal number.
// - Status: students publish step, loss, tokens/s, ... in their areas of the
//   segment (Client::publishStatus); on a terminal one live line shows the
//   slowest student's step, the mean loss, the summed tokens/s and how busy the
//   teacher is (its share of time in forward, published in the segment);
//   otherwise a plain status line every run.status_every_s and one at the end.
// - transport.cuda_mps: on: an MPS server of its own for the node's ranks,
//   started before them and stopped after them (mps.h).
// - The watchdog's verdict (watchdog.h): the hang table to the console and
//   <log_dir>/hang_report.txt, then per run.on_hang a teardown or nothing.
//   SIGUSR1 prints the same table at any time and changes nothing.
//
// Rendezvous (group/rendezvous.h): node 0 binds the student group's store
// socket to run.master_addr:run.master_port before anything starts (a port in
// use fails here; 0 picks a free one on a single node) and hands it to student
// rank 0 (DISTILL_STORE_FD). Students get the job secret in
// DISTILL_JOB_SECRET: made here for one node, taken from this process's
// environment (the same on every node) for several.

#include <signal.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "args.h"
#include "balance.h"
#include "console.h"
#include "distill/core/config.h"
#include "distill/core/sys.h"
#include "distill/ipc/segment.h"
#include "mps.h"
#include "ranks.h"
#include "watchdog.h"

namespace distill::launcher {

// How often the supervisor samples the segment: the status line, the watchdog.
constexpr auto kSampleEvery = std::chrono::milliseconds(100);

class Supervisor {
 public:
  Supervisor(Args args, Config cfg);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Runs the node's part of the job: 0 when every rank exited 0, 128 + the
  // signal after SIGINT/SIGTERM, else 1. --dry-run prints the plan only.
  int run();

 private:
  void layOut(const std::string& segment, const std::string& jobId);
  int printPlan(const std::string& segment) const;
  std::string assignmentText() const;
  void rendezvousEnv(int nnodes);
  void bindStore();
  void blockSignals();
  void createSegment(const std::string& segment, const std::string& jobId);
  void start(Rank& r);
  void privateLog(const std::string& name) const;

  int loop();
  void pollOnce();
  void readSignals();
  void onSignal(int sig);
  void reap();
  void onExit(Rank& r, int status);
  void checkRanks();
  void checkDeadlines();
  void tick();
  bool readStatuses();
  std::string status() const;
  std::optional<double> cacheHits() const;
  std::string cacheNote(bool verdict) const;
  int finish();

  std::string exitZeroProblem(const Rank& r) const;
  bool allExited() const;
  bool mayRestartTeacher(const Rank& teacher) const;
  void restartTeacher(Rank& r);
  void reportHang(const std::string& table);
  void onVerdict(const Verdict& v);
  void teardown(const std::string& why);
  void noteStoppedRanks();
  void afterStudents();
  void removeSegment();

  Args a_;
  Config cfg_;
  std::vector<Rank> ranks_;
  std::optional<ipc::Segment> seg_;
  std::string segmentName_;
  int node_ = 0;
  Fd storeFd_; // node 0: the store's listening socket until student rank 0 has it
  Rank* storeRank_ = nullptr; // the rank that serves the store
  Fd sigfd_;
  sigset_t oldMask_{};
  Console console_;
  Watchdog watchdog_;
  Balance balance_; // the end-of-job verdict: sampled on each status tick
  std::string reason_; // why the job did not end normally ("" = it did)
  int stopSignal_ = 0; // first SIGINT/SIGTERM received
  std::optional<Deadline> stopDeadline_;
  std::optional<Deadline> teardownDeadline_;
  int64_t teardownStartNs_ = 0; // monotonicNs() when the teardown began
  bool killed_ = false;
  // Every student of the node exited 0: the teachers have run.stop_grace_s to exit.
  std::optional<Deadline> studentsDoneDeadline_;
  Rank* failedRank_ = nullptr;
  bool hung_ = false; // torn down for a hang
  Deadline nextSample_;
  bool statusSeen_ = false; // a student published a status (Client::publishStatus)
  bool teacherAttached_ = false; // from then on its busy share (published by serve()) is shown
  std::optional<MpsServer> mps_; // transport.cuda_mps: on: stopped once the ranks have exited
};

} // namespace distill::launcher
