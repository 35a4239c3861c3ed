#pragma once

// Per-process logging. Every line goes to stderr, whole, prefixed with the
// process identity ("[n0 r3 student]") so that interleaved output of many ranks
// stays attributable. Thread safe: one write(2) per line.

#include <cstdint>
#include <sstream>
#include <string>

namespace distill {

enum class Role { kStudent, kTeacher, kLauncher, kUnknown };
const char* roleName(Role role);

// Who this process is; set once at start-up (init, launcher), read by logging
// and by every error message.
struct Identity {
  int node = -1; // node rank, -1 if unknown
  int rank = -1; // global rank (students and teachers), -1 if unknown
  Role role = Role::kUnknown;
};

void setIdentity(const Identity& id);

Identity identity();
// "[n0 r3 student]", or "[distill]" before setIdentity.
std::string identityPrefix();

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
// Lines below this level are dropped. Default: kInfo, or DISTILL_LOG_LEVEL=debug|info|warning|error.
void setLogLevel(LogLevel level);
bool logEnabled(LogLevel level);
void logLine(LogLevel level, const std::string& text);

namespace detail {
class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage() { logLine(level_, os_.str()); }
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostringstream& stream() { return os_; }

 private:
  LogLevel level_;
  std::ostringstream os_;
};
} // namespace detail

} // namespace distill

// DISTILL_LOG(kInfo) << "attached to " << name;
#define DISTILL_LOG(level)                                  \
  if (!::distill::logEnabled(::distill::LogLevel::level)) { \
  } else                                                    \
    ::distill::detail::LogMessage(::distill::LogLevel::level).stream()
