#include "distill/ipc/hang_report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "distill/core/clock.h"
#include "distill/core/tag.h"
#include "recorder.h"
#include "ring.h"
#include "segment_impl.h"
#include "sys.h"

namespace distill::ipc {
namespace {

using trace::Op;
using wire::ProcState;

std::string seconds(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", double(ns) / 1e9);
  return buf;
}

std::string duration(int64_t ns) {
  char buf[32];
  if (ns < 1000000000) {
    std::snprintf(buf, sizeof buf, "%.2f ms", double(ns) / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f s", double(ns) / 1e9);
  }
  return buf;
}

std::string tag(int64_t step, int64_t accStep, uint64_t seq) { return "(" + describe(Tag{seq, step, accStep}) + ")"; }

std::string peerName(const SegmentImpl& s, int rank) {
  if (rank < 0) return "any student";
  for (int i = 0; i < s.numProcesses(); ++i) {
    if (s.process(i).pid.load(std::memory_order_relaxed) != 0 &&
        s.process(i).rank.load(std::memory_order_relaxed) == rank)
      return std::string(s.isTeacher(i) ? "teacher" : "student") + " rank " + std::to_string(rank);
  }
  return "rank " + std::to_string(rank);
}

std::string eventText(const SegmentImpl& s, const RecordedEvent& e, int64_t now) {
  std::ostringstream os;
  os << seconds(now - e.startNs) << " ago: " << trace::opName(e.op);
  if (!e.label.empty()) os << " '" << e.label << "'";
  switch (e.op) {
    case Op::kSend:
    case Op::kReply:
      os << " to " << peerName(s, e.peer);
      break;
    case Op::kReceive:
    case Op::kRequest:
      os << " from " << peerName(s, e.peer);
      break;
    default:
      break;
  }
  if (e.op == Op::kCollective) {
    os << " #" << e.seq;
    if (e.step >= 0) os << " (step " << e.step << ", acc_step " << e.accStep << ")";
  } else if (e.step >= 0) {
    os << " " << tag(e.step, e.accStep, e.seq);
  }
  os << (e.open() ? ", still open" : ", took " + duration(e.endNs - e.startNs));
  return os.str();
}

// The number of the newest collective `events` show (0 if none).
uint64_t lastCollective(const std::vector<RecordedEvent>& events) {
  for (auto it = events.rbegin(); it != events.rend(); ++it)
    if (it->op == Op::kCollective) return it->seq;
  return 0;
}

const RecordedEvent* innermostOpen(const std::vector<RecordedEvent>& events) {
  for (auto it = events.rbegin(); it != events.rend(); ++it)
    if (it->open()) return &*it;
  return nullptr;
}

} // namespace

bool processStopped(int pid) { return sys::pidState(pid) == sys::PidState::kStopped; }

uint64_t progressCount(const Segment& seg) {
  const SegmentImpl& s = *seg.impl();
  uint64_t sum = 0;
  for (int i = 0; i < s.numProcesses(); ++i) {
    sum += s.recorder(i).progress.load(std::memory_order_acquire);
    sum += s.process(i).incarnation.load(std::memory_order_relaxed);
    sum += s.process(i).state.load(std::memory_order_relaxed) == uint32_t(ProcState::kFinished) ? 1 : 0;
  }
  return sum;
}

namespace {

// One look at the segment for the hang table: every process's recorded
// history and whether it is stopped, taken once; then one row per process.
class ActivityScan {
 public:
  explicit ActivityScan(const SegmentImpl& s) : s_(s), now_(monotonicNs()) {
    // Enough history to find each student's newest collective, even behind ring traffic.
    for (int i = 0; i < s.numProcesses(); ++i) history_.push_back(readEvents(s.recorder(i), wire::kRecorderEvents));
    // Which attached processes are stopped (SIGSTOP, a debugger): from the
    // kernel's process state, as the liveness checks of the waits read it. A
    // stopped process cannot update its own row, which still shows what it was
    // doing when it stopped; whoever waits on it must not look like the culprit.
    for (int i = 0; i < s.numProcesses(); ++i) {
      const auto& e = s.process(i);
      const int pid = e.pid.load(std::memory_order_acquire);
      const auto st = ProcState(e.state.load(std::memory_order_acquire));
      stopped_.push_back(pid != 0 && st != ProcState::kFinished && st != ProcState::kDead &&
                         sys::pidState(pid) == sys::PidState::kStopped);
    }
  }

  ProcessActivity row(int i, int events) const {
    const auto& e = s_.process(i);
    ProcessActivity a;
    a.localIndex = i;
    a.role = s_.isTeacher(i) ? "teacher" : "student";
    a.pid = e.pid.load(std::memory_order_acquire);
    const auto state = ProcState(e.state.load(std::memory_order_acquire));
    a.state = wire::stateName(uint32_t(state));
    a.rank = a.pid ? e.rank.load(std::memory_order_relaxed) : -1;
    const auto& ev = history_[size_t(i)];
    const uint32_t what = e.waitWhat.load(std::memory_order_relaxed);
    std::ostringstream doing;
    if (stopped_[size_t(i)]) {
      a.stopped = true;
      a.state = "stopped";
      doing << "stopped (SIGSTOP): no heartbeat for " << seconds(now_ - e.heartbeatNs.load(std::memory_order_relaxed))
            << "; when it stopped it was ";
    }
    if (a.pid == 0) {
      doing << "never attached to the segment";
    } else if (state == ProcState::kFinished) {
      doing << "finished (detached cleanly)";
    } else if (state == ProcState::kDead) {
      doing << "detached abnormally";
    } else if (state == ProcState::kWaiting && what != 0) {
      waiting(i, what, doing);
    } else if (const RecordedEvent* open = innermostOpen(ev)) {
      inCall(i, *open, doing);
    } else {
      inUserCode(i, doing);
    }
    a.doing = doing.str();
    const size_t from = ev.size() > size_t(events) ? ev.size() - size_t(events) : 0;
    for (size_t k = from; k < ev.size(); ++k) a.lastEvents.push_back(eventText(s_, ev[k], now_));
    return a;
  }

 private:
  bool isStopped(int rank) const {
    for (int j = 0; j < s_.numProcesses(); ++j)
      if (stopped_[size_t(j)] && s_.process(j).rank.load(std::memory_order_relaxed) == rank) return true;
    return false;
  }
  // The local indices of the students of teacher `i`, or of the students of the node.
  std::vector<int> studentsOf(int i) const {
    if (s_.isTeacher(i)) return studentsServedBy(s_, i);
    std::vector<int> all;
    for (int j = 0; j < s_.layout.numStudents; ++j) all.push_back(j);
    return all;
  }
  // "; waits on a stopped peer: student rank 1 is stopped (SIGSTOP)" for the stopped
  // processes among local indices `among` other than `self`; "" if none.
  std::string stoppedAmong(const std::vector<int>& among, int self) const {
    std::string names;
    for (int j : among)
      if (j != self && stopped_[size_t(j)])
        names += (names.empty() ? "" : ", ") + peerName(s_, s_.process(j).rank.load(std::memory_order_relaxed));
    return names.empty() ? std::string() : "; waits on a stopped peer: " + names + " is stopped (SIGSTOP)";
  }

  // Process i waits (its row's wait fields) for `what`.
  void waiting(int i, uint32_t what, std::ostringstream& doing) const {
    const auto& e = s_.process(i);
    const int peer = e.waitPeer.load(std::memory_order_relaxed);
    const int64_t since = e.waitSinceNs.load(std::memory_order_relaxed);
    doing << "waiting for " << wire::waitName(what);
    if (what == uint32_t(wire::WaitWhat::kAdmission) && s_.isTeacher(i)) {
      std::string missing;
      for (int j : studentsOf(i)) {
        const auto st = ProcState(s_.process(j).state.load(std::memory_order_relaxed));
        if (s_.process(j).pid.load(std::memory_order_relaxed) == 0 || st == ProcState::kDead)
          missing += (missing.empty() ? "" : ", ") + std::string("local ") + std::to_string(j);
      }
      if (!missing.empty()) doing << " (not attached: student " << missing << ")";
    } else if (what == uint32_t(wire::WaitWhat::kAdmission)) {
      doing << " by the teacher";
    } else if (what == uint32_t(wire::WaitWhat::kRequest)) {
      doing << " from " << peerName(s_, peer);
    } else {
      doing << (what == uint32_t(wire::WaitWhat::kResponse) ? " from " : " towards ") << peerName(s_, peer) << " "
            << tag(e.waitStep.load(std::memory_order_relaxed), e.waitAccStep.load(std::memory_order_relaxed),
                   e.waitSeq.load(std::memory_order_relaxed));
    }
    doing << " for " << seconds(now_ - since);
    if (stopped_[size_t(i)]) return;
    if (s_.isTeacher(i))
      doing << stoppedAmong(studentsOf(i), i); // any of its students
    else if (peer >= 0 && isStopped(peer))
      doing << "; waits on a stopped peer: " << peerName(s_, peer) << " is stopped (SIGSTOP)";
    else if (what == uint32_t(wire::WaitWhat::kAdmission))
      doing << stoppedAmong({teacherOf(s_, i)}, i);
  }

  // Process i is inside a distill call or the teacher's forward (`open`).
  void inCall(int i, const RecordedEvent& open, std::ostringstream& doing) const {
    if (open.op == Op::kForward) {
      doing << "busy in user code: the model's forward";
      if (!open.label.empty()) doing << " (" << open.label << ")";
      doing << " for " << seconds(now_ - open.startNs);
    } else if (open.op == Op::kCollective) {
      doing << "in student group " << (open.label.empty() ? "collective" : open.label) << " #" << open.seq;
      if (open.step >= 0) doing << " at step " << open.step << " acc_step " << open.accStep;
      doing << " for " << seconds(now_ - open.startNs);
      std::string behind;
      for (int j = 0; j < s_.layout.numStudents; ++j) {
        if (j == i || s_.process(j).pid.load(std::memory_order_relaxed) == 0) continue;
        const uint64_t theirs = lastCollective(history_[size_t(j)]);
        if (theirs < open.seq)
          behind += (behind.empty() ? "" : ", ") + std::string("student rank ") +
              std::to_string(s_.process(j).rank.load(std::memory_order_relaxed)) + " (its last: #" +
              std::to_string(theirs) + (stopped_[size_t(j)] ? ", stopped" : "") + ")";
      }
      if (!behind.empty()) doing << "; not entered by " << behind;
      if (!stopped_[size_t(i)]) doing << stoppedAmong(studentsOf(-1), i);
    } else {
      doing << "in " << trace::opName(open.op);
      if (!open.label.empty()) doing << " " << open.label;
      if (open.step >= 0) doing << " at step " << open.step;
      doing << " for " << seconds(now_ - open.startNs);
    }
  }

  // Process i is outside every distill call.
  void inUserCode(int i, std::ostringstream& doing) const {
    const auto& ev = history_[size_t(i)];
    const int64_t since = s_.recorder(i).lastEndNs.load(std::memory_order_relaxed);
    doing << "busy in user code for " << seconds(now_ - since);
    if (ev.empty()) {
      doing << " (since it attached)";
      return;
    }
    const auto& l = ev.back();
    doing << " (since its last distill call ended: " << trace::opName(l.op);
    if (l.op == Op::kCollective) doing << " #" << l.seq;
    if (l.step >= 0) doing << " at step " << l.step << " acc_step " << l.accStep;
    doing << ")";
  }

  const SegmentImpl& s_;
  int64_t now_;
  std::vector<std::vector<RecordedEvent>> history_;
  std::vector<bool> stopped_;
};

} // namespace

std::vector<ProcessActivity> describeActivity(const Segment& seg, int events) {
  const ActivityScan scan(*seg.impl());
  std::vector<ProcessActivity> out;
  for (int i = 0; i < seg.impl()->numProcesses(); ++i) out.push_back(scan.row(i, events));
  return out;
}

std::string formatHangTable(const Segment& seg, const std::string& title, const std::map<int, std::string>& notes,
                            int events) {
  auto acts = describeActivity(seg, events);
  std::ostringstream os;
  os << title << "\n";
  char row[160];
  std::snprintf(row, sizeof row, "  %-6s %-8s %-8s %-9s %s\n", "rank", "role", "pid", "state", "doing");
  os << row;
  for (auto& a : acts) {
    const std::string rank = a.rank >= 0 ? "r" + std::to_string(a.rank) : "local" + std::to_string(a.localIndex);
    std::snprintf(row, sizeof row, "  %-6s %-8s %-8d %-9s ", rank.c_str(), a.role.c_str(), a.pid, a.state.c_str());
    os << row << a.doing;
    auto n = notes.find(a.localIndex);
    if (n != notes.end() && !n->second.empty()) os << " [" << n->second << "]";
    os << "\n";
  }
  // The culprits first: nothing a stopped process's peers do can move the job.
  for (auto& a : acts) {
    if (!a.stopped) continue;
    const std::string rank = a.rank >= 0 ? "r" + std::to_string(a.rank) : "local" + std::to_string(a.localIndex);
    os << "  stopped: " << rank << " " << a.role << " (pid " << a.pid
       << ") is stopped (SIGSTOP); the ranks waiting on it cannot go on (kill -CONT " << a.pid << " resumes it)\n";
  }
  for (auto& a : acts) {
    if (a.lastEvents.empty()) continue;
    const std::string rank = a.rank >= 0 ? "r" + std::to_string(a.rank) : "local" + std::to_string(a.localIndex);
    os << "  last " << a.lastEvents.size() << " events of " << rank << " " << a.role << ":\n";
    for (auto& l : a.lastEvents) os << "    " << l << "\n";
  }
  return os.str();
}

} // namespace distill::ipc
