#pragma once

// What every process of a node is doing, read from the segment: the process
// table (state, current wait) and each process's flight recorder. distill-run
// prints it as the hang table when no rank made progress for
// run.hang_timeout_s, and on SIGUSR1 at any time.
//
// Reading never disturbs the processes (no lock, no signal): a process that
// writes while it is read shows its previous or its next event.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "distill/ipc/segment.h"

namespace distill::ipc {

struct ProcessActivity {
  int localIndex = -1;
  int rank = -1; // global rank (-1: never attached)
  std::string role; // student | teacher
  int pid = 0; // 0: never attached
  std::string state; // process-table state, or "stopped" (SIGSTOP: kernel process state)
  bool stopped = false; // the process is stopped (SIGSTOP, a debugger): the culprit of a stall
  // One phrase: "waiting for response from teacher rank 2 (step 3, acc_step 0,
  // seq 7) for 3.2 s", "in student group barrier #4 for 3.1 s; not entered by
  // student rank 1 (its last collective: #3)", "busy in user code for 3.3 s
  // (since its last distill call ended)", "never attached to the segment".
  // A stopped process: "stopped (SIGSTOP): no heartbeat for 3.2 s; when it
  // stopped it was <phrase>"; one that waits on a stopped peer ends with
  // "; waits on a stopped peer: teacher rank 2 is stopped (SIGSTOP)".
  std::string doing;
  std::vector<std::string> lastEvents; // newest last, "2.1 s ago: receive from r2 (step 3, ...) 0.4 ms"
};

// Everyone's activity; `lastEvents` holds at most `events` entries each.
std::vector<ProcessActivity> describeActivity(const Segment& seg, int events = 5);

// Whether process `pid` is stopped (SIGSTOP, a debugger), from its kernel
// state (/proc/<pid>/stat), as the waits' liveness checks read it.
bool processStopped(int pid);

// Changes whenever any process begins or ends an event (the watchdog's
// measure of progress; heartbeats do not count).
uint64_t progressCount(const Segment& seg);

// The table: a header line with `title`, one row per process (rank, role, pid,
// state, what it is doing), a "stopped: ..." line per stopped process (the
// culprit of the stall), then each process's last events. `notes` adds the
// launcher's view of a local index (e.g. "exited with code 0", "running, never
// called distill") to its row.
std::string formatHangTable(const Segment& seg, const std::string& title, const std::map<int, std::string>& notes = {},
                            int events = 5);

} // namespace distill::ipc
