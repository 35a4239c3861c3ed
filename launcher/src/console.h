#pragma once

// distill-run's console: every rank's output prefixed ("[r3 student] ") and
// kept whole in its log file; on a terminal one live status line that stays
// the last line, otherwise a plain status line every run.status_every_s. The
// status comes from the segment (Client::publishStatus), never from output.

#include <optional>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/ipc/segment.h"
#include "ranks.h"

namespace distill::launcher {

class Console {
 public:
  Console(bool tty, double statusEveryS);

  bool tty() const { return tty_; }
  // Writes to stdout; on a terminal the live status line is cleared first.
  void write(const std::string& text);
  // Moves off the live line (before a log line goes to stderr).
  void leaveLiveLine();

  // Reads what `r` wrote (non-blocking): whole lines to its log and, prefixed,
  // to the console; `flush` also a last line without '\n' (the rank ended).
  // Closes r.out at EOF.
  void pump(Rank& r, bool flush);

  // The status: on a terminal the live line (redrawn when it changes), else a
  // plain line when run.status_every_s has passed since the last.
  void showStatus(const std::string& text);
  // A plain status line now (the last one, at the end of the job).
  void printStatus(const std::string& text);

 private:
  void emit(Rank& r, const std::string& line);

  bool tty_;
  double statusEveryS_;
  bool liveShown_ = false;
  std::string live_; // the live line on the terminal
  Deadline nextStatus_;
};

// "step=12 loss=0.53 tokens/s=12000 teacher busy=43% teacher wait=20%": the
// slowest student's step, mean loss, summed tokens/s over the students that
// reported; each teacher's busy share once one attached (empty before; a pool
// shows "teachers busy=71%/64%"); the cache hit share (hits / rows looked up)
// and `cacheNote` ("cache full (6316 B/token)") when given; the
// students' mean share of a step spent waiting for the teacher. "no status yet".
// " stalled: teacher r2 (no heartbeat for 3.1 s)" for each attached process
// whose heartbeat is older than two periods; "" when none is.
std::string stallText(const std::vector<ipc::ProcessSnapshot>& procs, int heartbeatMs);
std::string statusText(const std::vector<Rank>& ranks, const std::vector<double>& teacherBusy,
                       std::optional<double> cacheHits = std::nullopt, const std::string& cacheNote = "");

} // namespace distill::launcher
