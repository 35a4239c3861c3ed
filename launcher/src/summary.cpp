#include "summary.h"

#include <sys/wait.h>

#include <algorithm>
#include <regex>
#include <sstream>

namespace distill::launcher {
namespace {

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

// It detached abnormally (an exception), before any teardown.
bool detachedAbnormally(const ipc::ProcessSnapshot* p, int64_t teardownStartNs) {
  return p && p->state == "dead" && p->endedNs > 0 && (!teardownStartNs || p->endedNs <= teardownStartNs);
}

// Killed by the teardown's own SIGTERM or SIGKILL.
bool endedByTeardown(const Rank& r) {
  const int sig = WIFSIGNALED(r.status) ? WTERMSIG(r.status) : 0;
  return (sig == SIGTERM && r.termSentNs) || (sig == SIGKILL && r.killSentNs);
}

// When and how `r` failed, if it caused a failure (rank null if not).
FirstFailure failureOf(const Rank& r, const ipc::ProcessSnapshot* p, int64_t teardownStartNs) {
  const std::string ended = r.exited ? describeStatus(r.status) : "still running";
  if (detachedAbnormally(p, teardownStartNs))
    return {&r, r.prefix + "detached abnormally from the segment (then " + ended + ")", p->endedNs};
  if (r.stoppedSinceNs) return {&r, r.prefix + "was stopped (SIGSTOP) (then " + ended + ")", r.stoppedSinceNs};
  if (!failed(r) || endedByTeardown(r)) return {};
  int64_t at = r.exitedNs;
  // Died while attached: its last heartbeat is a lower bound of the death.
  if (p && p->state != "finished" && p->state != "dead" && p->heartbeatNs > 0) at = std::min(at, p->heartbeatNs);
  return {&r, howItEnded(r), at};
}

FirstFailure firstFailure(const std::vector<Rank>& ranks, const ipc::Segment* seg, int64_t teardownStartNs) {
  FirstFailure best;
  const auto procs = seg ? seg->processes() : std::vector<ipc::ProcessSnapshot>{};
  for (auto& r : ranks) {
    const size_t local = size_t(r.topo.localRank);
    const ipc::ProcessSnapshot* p = local < procs.size() && procs[local].pid == r.pid ? &procs[local] : nullptr;
    const FirstFailure f = failureOf(r, p, teardownStartNs);
    if (f.rank && (!best.rank || f.atNs < best.atNs)) best = f;
  }
  return best;
}

// The exception a Python rank ended with, as its traceback's last line says
// ("KeyboardInterrupt", "distill._C.ProtocolError: ..."); "" if none shows.
std::string pythonException(const Rank& r) {
  static const std::regex kLine(R"(^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(: .*)?$)");
  for (auto it = r.tail.rbegin(); it != r.tail.rend(); ++it)
    if (std::regex_match(*it, kLine)) return *it;
  return "";
}

// A student of another node that the student group saw lost first, as the
// last lines of `first` (else of another rank) name it ("student rank 2 (r3
// on node 1) was lost first"): "[r3 student] on node 1". "" if none, or if it
// is of this node.
std::string remoteLostFirst(const std::vector<Rank>& ranks, const Rank& first) {
  static const std::regex kLost(R"(student rank \d+ \(r(\d+) on node (\d+)\) was lost first)");
  std::vector<const Rank*> order{&first};
  for (auto& r : ranks) order.push_back(&r);
  std::smatch m;
  for (const Rank* r : order) {
    for (auto& line : r->tail) {
      if (std::regex_search(line, m, kLost) && std::stoi(m[2]) != r->topo.nodeRank)
        return "[r" + m[1].str() + " student] on node " + m[2].str();
    }
  }
  return "";
}

} // namespace

// The teachers' deaths, "; "-separated; in a pool each named by its index
// ("teacher 1: signal SIGKILL (Killed)").
std::string deathsText(const std::vector<Rank>& ranks) {
  std::string how;
  for (auto& r : ranks) {
    const std::string who =
        r.topo.isTeacher() && r.topo.teachersPerNode > 1 ? "teacher " + std::to_string(r.topo.teacherIndex) + ": " : "";
    for (auto& d : r.deaths) how += (how.empty() ? "" : "; ") + who + d;
  }
  return how;
}

// ", teacher restarted 1 of 2 times (...)"; in a pool the bound is per teacher:
// ", teachers restarted 3 times, at most 2 each (...)".
std::string restartsText(const std::vector<Rank>& ranks, int restarts, int maxRestarts) {
  if (restarts == 0) return "";
  const bool pool = !ranks.empty() && ranks.back().topo.teachersPerNode > 1;
  if (pool)
    return ", teachers restarted " + std::to_string(restarts) + " time" + (restarts == 1 ? "" : "s") + ", at most " +
        std::to_string(maxRestarts) + " each (" + deathsText(ranks) + ")";
  return ", teacher restarted " + std::to_string(restarts) + " of " + std::to_string(maxRestarts) + " times (" +
      deathsText(ranks) + ")";
}

std::string summaryText(const std::vector<Rank>& ranks, const ipc::Segment* seg, const Ending& e) {
  std::ostringstream os;
  const Rank* tail = e.failedRank;
  std::string headline = e.reason;
  if (e.failedRank && !e.hung) {
    const FirstFailure first = firstFailure(ranks, seg, e.teardownStartNs);
    if (first.rank) {
      headline = first.how;
      tail = first.rank;
      // A teacher that gave up says which request of which student failed twice, and how.
      const std::string gaveUp = seg && first.rank->topo.isTeacher() ? seg->teacherGaveUpReason() : "";
      if (!gaveUp.empty()) {
        headline += ": " + gaveUp;
      } else if (const std::string ex = pythonException(*first.rank); !ex.empty()) {
        headline += ": " + ex;
      }
      if (first.rank != e.failedRank) headline += "; distill-run noticed " + howItEnded(*e.failedRank) + " first";
      // A student of another node failed before any of this node's ranks: named
      // first, in the job's one numbering (its node's summary says how it ended).
      if (const std::string remote = remoteLostFirst(ranks, *first.rank); !remote.empty())
        headline = remote + " was lost first (its node's distill-run says how); here " + headline;
    }
  }
  os << "\n==== distill-run: job " << (e.failedRank || e.hung ? "failed" : "stopped") << ": " << headline << "\n";
  for (auto& r : ranks) {
    os << "  " << (r.exited ? howItEnded(r) : r.prefix + "still running");
    if (r.published && r.published->step >= 0) os << ", last step " << r.published->step;
    os << "\n";
  }
  if (e.maxRestarts > 0) {
    const std::string deaths = deathsText(ranks);
    const bool pool = !ranks.empty() && ranks.back().topo.teachersPerNode > 1;
    os << "  teacher restarts: " << e.restarts << " of " << e.maxRestarts << (pool ? " each" : "")
       << (deaths.empty() ? "" : " (" + deaths + ")") << "\n";
  }
  if (tail) {
    os << "  last lines of " << tail->prefix.substr(0, tail->prefix.size() - 1) << ":\n";
    for (auto& l : tail->tail) os << "    | " << l << "\n";
  }
  return os.str();
}

} // namespace distill::launcher
