#include "distill/core/errors.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>

#include "distill/core/logging.h"
#include "distill/core/trace.h"

namespace distill {
namespace {

// An error that names no step reports the one this process is working on.
ErrorWhere withCurrentStep(ErrorWhere w) {
  int64_t step = 0, accStep = 0;
  if (!w.step && trace::currentStep(&step, &accStep)) {
    w.step = step;
    w.accStep = accStep;
  }
  return w;
}

std::string format(const std::string& msg, const ErrorWhere& w, const char* file, int line) {
  std::ostringstream os;
  os << identityPrefix() << ' ' << msg;
  if (w.step || w.accStep || !w.awaited.empty()) {
    os << " [";
    const char* sep = "";
    if (w.step) {
      os << "step=" << *w.step;
      sep = " ";
    }
    if (w.accStep) {
      os << sep << "acc_step=" << *w.accStep;
      sep = " ";
    }
    if (!w.awaited.empty()) os << sep << "awaiting: " << w.awaited;
    os << ']';
  }
  const char* base = std::strrchr(file, '/');
  os << " (" << (base ? base + 1 : file) << ':' << line << ')';
  return os.str();
}

} // namespace

Error::Error(std::string msg, ErrorWhere where, const char* file, int line)
    : std::runtime_error(format(msg, withCurrentStep(where), file, line)),
      msg_(std::move(msg)),
      where_(withCurrentStep(std::move(where))),
      file_(file),
      line_(line) {}

const char* errorTypeName(const Error& e) {
#define DISTILL_ERROR_NAME(Name) \
  if (dynamic_cast<const Name*>(&e)) return #Name;
  DISTILL_ERROR_TYPES(DISTILL_ERROR_NAME)
#undef DISTILL_ERROR_NAME
  return "Error";
}

namespace {

std::terminate_handler gPreviousTerminate = nullptr;

[[noreturn]] void onTerminate() {
  if (std::exception_ptr ep = std::current_exception()) {
    try {
      std::rethrow_exception(ep);
    } catch (const Error& e) {
      // what() starts with this process's identity, which logLine writes too.
      std::string what = e.what();
      const std::string prefix = identityPrefix() + " ";
      if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
      std::cout.flush();
      std::fflush(nullptr);
      logLine(LogLevel::kError,
              std::string("uncaught ") + errorTypeName(e) + " (exit code " + std::to_string(kUncaughtErrorExitCode) +
                  "): " + what);
      ::_exit(kUncaughtErrorExitCode);
    } catch (...) {
    }
  }
  if (gPreviousTerminate) gPreviousTerminate();
  std::abort();
}

} // namespace

void exitOnUncaughtError() {
  static std::once_flag once;
  std::call_once(once, [] { gPreviousTerminate = std::set_terminate(onTerminate); });
}

std::string errnoString(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(err, buf, sizeof buf);
  return std::string(s) + " (errno " + std::to_string(err) + ")";
}

} // namespace distill
