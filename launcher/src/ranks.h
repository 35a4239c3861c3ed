#pragma once

// The ranks of one node: the Rank record, spawning one (fork+exec in its own
// process group, PDEATHSIG, its output through a pipe), signalling and reaping.

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "distill/core/status.h"
#include "distill/core/sys.h"
#include "distill/core/topology.h"

namespace distill::launcher {

struct Rank {
  Topology topo;
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  pid_t pid = -1;
  Fd out; // read end of its stdout+stderr (non-blocking)
  std::string partial;
  std::deque<std::string> tail;
  std::ofstream log;
  bool exited = false;
  int status = 0;
  std::string prefix; // "[r3 student] " on the console
  std::string ownPrefix; // "[n0 r3 " : lines distill already prefixed get no second prefix
  std::optional<StudentStatus> published; // a student's last status read from the segment
  std::vector<std::string> deaths; // teacher: how each restarted incarnation ended
  // When things happened to it (monotonicNs, 0 = never): for the summary's
  // "who failed first", which is not always who exited first.
  int64_t exitedNs = 0; // reaped
  int64_t termSentNs = 0; // the teardown's SIGTERM
  int64_t killSentNs = 0; // the teardown's SIGKILL
  int64_t stoppedSinceNs = 0; // stopped (SIGSTOP) when the teardown began: its last heartbeat
  std::string exitProblem; // exit code 0 that is still a failure (never attached, left attached)
  bool endedAfterStudents = false; // a teacher ended by distill-run after its node's students all exited 0
};

// "exit code 3", "signal SIGKILL (Killed)".
std::string describeStatus(int status);
// Exited with a non-zero code, a signal, or a 0 that is a failure (exitProblem);
// never a teacher that distill-run ended after every student had exited 0.
bool failed(const Rank& r);
// "[r1 student] exit code 3", or for an exit 0 that is a failure "[r1 student]
// exit code 0 without attaching to the segment (...)".
std::string howItEnded(const Rank& r);

// Starts `r`: its log file <logDir>/rank_<global>.log (kept open across
// restarts), a pipe for its stdout+stderr, fork+exec of r.argv with the
// environment plus r.env, in a process group of its own, with PDEATHSIG
// SIGTERM and the signal mask `childMask`. `inheritFd` (>= 0) survives the
// exec (the store's socket for student rank 0).
void spawn(Rank& r, const std::string& logDir, const sigset_t& childMask, int inheritFd);

// Signals a rank's process group (the rank and anything it started), if it runs.
void signalRank(const Rank& r, int sig);

// One exited child, without blocking: its pid and wait status, or pid 0.
struct Reaped {
  pid_t pid = 0;
  int status = 0;
};
Reaped reapOne();

} // namespace distill::launcher
