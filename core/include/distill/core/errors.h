#pragma once

// The one exception family of distill. Every error is typed by its origin so a
// caller can decide what to do (docs/errors.md says what, per type):
//
//   Error                      base; never thrown directly except by DISTILL_CHECK
//   └── one type per entry of DISTILL_ERROR_TYPES below
//
// Messages carry the identity of the process that threw ("[n0 r3 student]"),
// the source location, and — where the thrower knows them — step, acc_step and
// what was awaited. Throw through the DISTILL_* macros so file/line are recorded.

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace distill {

// What a failing operation was doing; every field is optional.
struct ErrorWhere {
  std::optional<int64_t> step; // training step of the message / wait, if known
  std::optional<int64_t> accStep; // gradient-accumulation index, if known
  std::string awaited; // what was being waited for, e.g. "response from teacher"
};

class Error : public std::runtime_error {
 public:
  // `what` is the fully formatted message (identity, text, where, location).
  Error(std::string msg, ErrorWhere where, const char* file, int line);

  // The message as given by the thrower, without identity or location.
  const std::string& message() const noexcept { return msg_; }
  const ErrorWhere& where() const noexcept { return where_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  std::string msg_;
  ErrorWhere where_;
  const char* file_;
  int line_;
};

// The one list of distill's error types, each a direct subclass of Error:
// X(Name). The C++ classes, errorTypeName, the Python classes (python/src/
// errors.cpp), distill's Python exports and docs/errors.md's table are all
// this list (tests/structure/check_errors.py checks the last two).
//   ConfigError      bad YAML, bad --set override, bad environment
//   UsageError       a call the API does not allow: out of order, a bad argument, the wrong role
//   IpcError         segment / ring / header problems
//   TimeoutError     a wait passed its deadline
//   PeerLostError    a peer process died or stopped heart-beating
//   ProtocolError    a peer sent something out of order (tags, shapes)
//   CheckpointError  save / load failed; nothing saved before is lost
//   NumericError     a student's loss or gradient that is not finite (loss.on_nonfinite error)
//   InternalError    a broken invariant: a bug in distill
#define DISTILL_ERROR_TYPES(X) \
  X(ConfigError)               \
  X(UsageError)                \
  X(IpcError)                  \
  X(TimeoutError)              \
  X(PeerLostError)             \
  X(ProtocolError)             \
  X(CheckpointError)           \
  X(NumericError)              \
  X(InternalError)

#define DISTILL_DECLARE_ERROR(Name)      \
  class Name : public ::distill::Error { \
   public:                               \
    using ::distill::Error::Error;       \
  };

DISTILL_ERROR_TYPES(DISTILL_DECLARE_ERROR)

#undef DISTILL_DECLARE_ERROR

namespace detail {

inline void appendAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void appendAll(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  appendAll(os, rest...);
}

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  appendAll(os, args...);
  return os.str();
}

// Overloads so a macro can take an optional leading ErrorWhere.
template <typename... Args>
std::pair<ErrorWhere, std::string> split(const ErrorWhere& w, const Args&... args) {
  return {w, ::distill::detail::str(args...)};
}
template <typename... Args>
std::pair<ErrorWhere, std::string> split(const Args&... args) {
  return {ErrorWhere{}, ::distill::detail::str(args...)};
}

template <typename E, typename... Args>
[[noreturn]] void throwError(const char* file, int line, const Args&... args) {
  auto [where, msg] = split(args...);
  throw E(std::move(msg), std::move(where), file, line);
}

} // namespace detail

// Where for a tagged operation: DISTILL_THROW(TimeoutError, at(step, acc, "x"), ...)
inline ErrorWhere at(int64_t step, int64_t accStep, std::string awaited = {}) {
  return ErrorWhere{step, accStep, std::move(awaited)};
}
inline ErrorWhere awaiting(std::string awaited) { return ErrorWhere{std::nullopt, std::nullopt, std::move(awaited)}; }

// Human-readable name of the current errno-style code.
std::string errnoString(int err);

// "ConfigError", "TimeoutError", ...: the most derived distill type of `e`
// ("Error" for the base).
const char* errorTypeName(const Error& e);

// Exit code of a process that an uncaught distill::Error ended (see below).
constexpr int kUncaughtErrorExitCode = 2;

// Installs a std::terminate handler (once; idempotent): a distill::Error that
// nobody caught ends the process with one log line — its type and message —
// and exit code kUncaughtErrorExitCode, instead of SIGABRT and a core dump; so
// a rank's bad config reads under distill-run as "exit code 2" with the
// message in the summary's last lines. stdio is flushed, no destructor runs
// (_exit: other threads may still hold locks). Any other exception, or a
// terminate without one, goes to the previous handler (abort). distill::init
// installs it; a trainer may call it first thing in main().
void exitOnUncaughtError();

} // namespace distill

// Throws `Type` with the concatenated message; the first argument may be an ErrorWhere.
#define DISTILL_THROW(Type, ...) ::distill::detail::throwError<::distill::Type>(__FILE__, __LINE__, __VA_ARGS__)

// Input, config and peer checks: a failure is the caller's or a peer's fault.
#define DISTILL_CHECK_T(Type, cond, ...) \
  do {                                   \
    if (!(cond)) {                       \
      DISTILL_THROW(Type, __VA_ARGS__);  \
    }                                    \
  } while (0)

#define DISTILL_CHECK(cond, ...) DISTILL_CHECK_T(Error, cond, __VA_ARGS__)

// Equality check that prints both values.
#define DISTILL_CHECK_EQ_T(Type, a, b, ...)                                                                         \
  do {                                                                                                              \
    const auto& distill_a_ = (a);                                                                                   \
    const auto& distill_b_ = (b);                                                                                   \
    if (!(distill_a_ == distill_b_)) {                                                                              \
      DISTILL_THROW(Type, ::distill::detail::str(__VA_ARGS__), " (expected ", #a, " == ", #b, ", got ", distill_a_, \
                    " vs ", distill_b_, ")");                                                                       \
    }                                                                                                               \
  } while (0)

// A broken invariant: a bug in distill, not bad input.
#define DISTILL_INTERNAL_ASSERT(cond, ...)                                                                         \
  do {                                                                                                             \
    if (!(cond)) {                                                                                                 \
      DISTILL_THROW(InternalError, "internal assertion failed: " #cond ". ", ::distill::detail::str(__VA_ARGS__)); \
    }                                                                                                              \
  } while (0)
