#include "distill/core/logging.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

namespace distill {
namespace {

std::mutex gIdentityMutex;
Identity gIdentity;

LogLevel levelFromEnv() {
  const char* v = std::getenv("DISTILL_LOG_LEVEL");
  if (!v) return LogLevel::kInfo;
  if (!std::strcmp(v, "debug")) return LogLevel::kDebug;
  if (!std::strcmp(v, "warning")) return LogLevel::kWarning;
  if (!std::strcmp(v, "error")) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::atomic<int> gLevel{static_cast<int>(levelFromEnv())};

const char* levelTag(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarning:
      return "W";
    case LogLevel::kError:
      return "E";
  }
  return "?";
}

} // namespace

const char* roleName(Role role) {
  switch (role) {
    case Role::kStudent:
      return "student";
    case Role::kTeacher:
      return "teacher";
    case Role::kLauncher:
      return "launcher";
    case Role::kUnknown:
      return "unknown";
  }
  return "unknown";
}

void setIdentity(const Identity& id) {
  std::lock_guard<std::mutex> g(gIdentityMutex);
  gIdentity = id;
}

Identity identity() {
  std::lock_guard<std::mutex> g(gIdentityMutex);
  return gIdentity;
}

std::string identityPrefix() {
  Identity id = identity();
  if (id.role == Role::kUnknown && id.rank < 0) return "[distill]";
  std::string s = "[";
  if (id.node >= 0) s += "n" + std::to_string(id.node) + " ";
  if (id.rank >= 0) s += "r" + std::to_string(id.rank) + " ";
  s += roleName(id.role);
  s += "]";
  return s;
}

void setLogLevel(LogLevel level) { gLevel.store(static_cast<int>(level)); }
bool logEnabled(LogLevel level) { return static_cast<int>(level) >= gLevel.load(); }

void logLine(LogLevel level, const std::string& text) {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t{};
  gmtime_r(&ts.tv_sec, &t);
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%02d:%02d:%02d.%03ld", t.tm_hour, t.tm_min, t.tm_sec, ts.tv_nsec / 1000000);
  std::string line = identityPrefix() + " " + levelTag(level) + " " + stamp + " " + text + "\n";
  // One write per line keeps lines whole when many processes share a pipe.
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

} // namespace distill
