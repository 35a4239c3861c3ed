#include "console.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "distill/core/sys.h"

namespace distill::launcher {
namespace {

constexpr size_t kTailLines = 20;
const std::string kStatusTag = "DISTILL_STATUS ";

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

// write(2) of all of `text` to stdout; a console that is gone loses it.
void writeAll(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = retryEintr([&] { return ::write(STDOUT_FILENO, text.data() + done, text.size() - done); });
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

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
    if (n == 0 || errno != EAGAIN) {  // EOF or an error: the rank's output ended
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
  if (parseStatus(line, r.reported)) {
    statusSeen_ = true;
    return;  // shown as the status line, kept in the log only
  }
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

std::string statusText(const std::vector<Rank>& ranks, std::optional<double> teacherBusy) {
  double step = -1, loss = 0, tps = 0;
  int nLoss = 0, nTps = 0;
  for (auto& r : ranks) {
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
  if (teacherBusy) os << "teacher busy=" << static_cast<int>(100 * *teacherBusy + 0.5) << "% ";
  std::string text = os.str();
  return text.empty() ? "no status yet" : text.substr(0, text.size() - 1);
}

}  // namespace distill::launcher
