#include "distill/core/errors.h"

#include <cstring>

#include "distill/core/logging.h"

namespace distill {
namespace {

// An error that names no step reports the one this process is working on.
ErrorWhere withCurrentStep(ErrorWhere w) {
  int64_t step = 0, accStep = 0;
  if (!w.step && currentStep(&step, &accStep)) {
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

}  // namespace

Error::Error(std::string msg, ErrorWhere where, const char* file, int line)
    : std::runtime_error(format(msg, withCurrentStep(where), file, line)),
      msg_(std::move(msg)),
      where_(withCurrentStep(std::move(where))),
      file_(file),
      line_(line) {}

std::string errnoString(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(err, buf, sizeof buf);
  return std::string(s) + " (errno " + std::to_string(err) + ")";
}

}  // namespace distill
