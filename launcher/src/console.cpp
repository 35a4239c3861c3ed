#include "console.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "distill/core/sys.h"

namespace distill::launcher {
namespace {

constexpr size_t kTailLines = 20;
// write(2) of all of `text` to stdout; a console that is gone loses it.
void writeAll(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = retryEintr([&] { return ::write(STDOUT_FILENO, text.data() + done, text.size() - done); });
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

} // namespace

Console::Console(bool tty, double statusEveryS)
    : tty_(tty), statusEveryS_(statusEveryS), nextStatus_(Deadline::afterSeconds(statusEveryS)) {}

void Console::write(const std::string& text) {
  if (tty_ && liveShown_) writeAll("\r\033[K");
  writeAll(text);
  liveShown_ = false;
}

void Console::leaveLiveLine() {
  if (liveShown_) write("");
}

void Console::pump(Rank& r, bool flush) {
  char buf[65536];
  for (;;) {
    const ssize_t n = retryEintr([&] { return ::read(r.out.get(), buf, sizeof buf); });
    if (n > 0) {
      r.partial.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0 || errno != EAGAIN) { // EOF or an error: the rank's output ended
      r.out.reset();
      flush = true;
    }
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

void Console::emit(Rank& r, const std::string& line) {
  r.log << line << '\n';
  r.log.flush();
  write((line.rfind(r.ownPrefix, 0) == 0 ? "" : r.prefix) + line + "\n");
  r.tail.push_back(line);
  if (r.tail.size() > kTailLines) r.tail.pop_front();
}

void Console::showStatus(const std::string& text) {
  if (tty_) {
    const std::string line = "\r\033[K[distill-run] " + text;
    if (liveShown_ && line == live_) return;
    writeAll(line);
    live_ = line;
    liveShown_ = true;
  } else if (nextStatus_.expired()) {
    printStatus(text);
  }
}

void Console::printStatus(const std::string& text) {
  write("[distill-run] status: " + text + "\n");
  nextStatus_ = Deadline::afterSeconds(statusEveryS_);
}

std::string statusText(const std::vector<Rank>& ranks, const std::vector<double>& teacherBusy,
                       std::optional<double> cacheHits, const std::string& cacheNote) {
  int64_t step = -1;
  double loss = 0, tps = 0, wait = 0, truncated = -1, masked = -1, skipped = -1;
  int nLoss = 0, nTps = 0, nWait = 0;
  for (auto& r : ranks) {
    if (!r.published) continue;
    const StudentStatus& s = *r.published;
    if (s.step >= 0) step = step < 0 ? s.step : std::min(step, s.step);
    if (!std::isnan(s.loss)) loss += s.loss, ++nLoss;
    if (!std::isnan(s.tokens_per_s)) tps += s.tokens_per_s, ++nTps;
    if (!std::isnan(s.teacher_wait_share)) wait += s.teacher_wait_share, ++nWait;
    if (!std::isnan(s.truncated_mass)) truncated = std::max(truncated, s.truncated_mass);
    // The same on every student (summed over them, or agreed): the largest is the latest.
    if (!std::isnan(s.masked_tokens)) masked = std::max(masked, s.masked_tokens);
    if (!std::isnan(s.skipped_steps)) skipped = std::max(skipped, s.skipped_steps);
  }
  std::ostringstream os;
  os << std::setprecision(4);
  if (step >= 0) os << "step=" << step << " ";
  if (nLoss) os << "loss=" << loss / nLoss << " ";
  if (nTps) os << "tokens/s=" << static_cast<int64_t>(tps) << " ";
  // One teacher: "teacher busy=93%"; a pool: "teachers busy=71%/64%", in teacher order.
  for (size_t t = 0; t < teacherBusy.size(); ++t)
    os << (t == 0 ? teacherBusy.size() > 1 ? "teachers busy=" : "teacher busy=" : "/")
       << static_cast<int>(100 * teacherBusy[t] + 0.5) << (t + 1 == teacherBusy.size() ? "% " : "%");
  if (cacheHits) os << "cache hits=" << static_cast<int>(100 * *cacheHits + 0.5) << "% ";
  if (!cacheNote.empty()) os << cacheNote << " ";
  if (nWait) os << "teacher wait=" << static_cast<int>(100 * wait / nWait + 0.5) << "% ";
  // loss.vocab truncate: the most teacher probability one token lost (docs/vocab.md).
  // teacher.on_nonfinite mask, loss.on_nonfinite skip_step: counted since the run started.
  if (masked >= 0) os << "masked tokens=" << static_cast<int64_t>(masked) << " ";
  if (skipped >= 0) os << "skipped steps=" << static_cast<int64_t>(skipped) << " ";
  if (truncated >= 0) os << "truncated mass=" << std::setprecision(2) << truncated << " ";
  std::string text = os.str();
  return text.empty() ? "no status yet" : text.substr(0, text.size() - 1);
}

std::string stallText(const std::vector<ipc::ProcessSnapshot>& procs, int heartbeatMs) {
  std::ostringstream os;
  for (const auto& p : procs) {
    if (p.pid == 0 || p.state == "finished" || p.state == "dead" || p.heartbeatAgeMs <= 2 * int64_t(heartbeatMs))
      continue;
    os << (os.tellp() == 0 ? " stalled: " : ", ") << p.role << " r" << p.rank << " (no heartbeat for " << std::fixed
       << std::setprecision(1) << double(p.heartbeatAgeMs) / 1000 << " s)";
  }
  return os.str();
}

} // namespace distill::launcher
