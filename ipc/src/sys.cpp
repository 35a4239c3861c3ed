#include "sys.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>

#include "distill/core/errors.h"

namespace distill::ipc::sys {

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  // Relative timeout (CLOCK_MONOTONIC). EAGAIN (value changed), ETIMEDOUT and
  // EINTR all mean "re-check"; the caller loops.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  retryEintr([&] {
    return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  });
}

std::pair<Fd, void*> createShmObject(const std::string& name, uint64_t bytes, const std::string& who) {
  const std::string path = "/dev/shm/" + name;
  Fd fd(retryEintr([&] { return ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600); }));
  DISTILL_CHECK_T(IpcError, bool(fd), who, ": cannot create '", path, "': ", errnoString(errno));
  int err = ::ftruncate(fd.get(), off_t(bytes)) == 0 ? 0 : errno;
  if (err == 0)
    do err = ::posix_fallocate(fd.get(), 0, off_t(bytes));
    while (err == EINTR);
  if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
    ::unlink(path.c_str());
    DISTILL_THROW(IpcError, who, ": cannot reserve ", bytes, " bytes of shared memory for '", path, "' (",
                  errnoString(err), "): give /dev/shm more room");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) {
    err = errno;
    ::unlink(path.c_str());
    DISTILL_THROW(IpcError, who, ": cannot map '", path, "' (", bytes, " bytes): ", errnoString(err));
  }
  return {std::move(fd), p};
}

std::string readSmallFile(const std::string& path) {
  Fd fd(retryEintr([&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC); }));
  if (!fd) return {};
  char buf[1024];
  ssize_t n = retryEintr([&] { return ::read(fd.get(), buf, sizeof buf); });
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

PidState pidState(int pid) {
  if (pid <= 0) return PidState::kGone;
  if (retryEintr([&] { return ::kill(pid, 0); }) != 0 && errno == ESRCH) return PidState::kGone;
  // kill() succeeds on a zombie (dead, not yet reaped by its parent): look at /proc.
  std::string stat = readSmallFile("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return PidState::kRunning; // no procfs: trust kill()
  char s = stat[close + 2];
  if (s == 'Z' || s == 'X') return PidState::kGone;
  if (s == 'T' || s == 't') return PidState::kStopped;
  return PidState::kRunning;
}

} // namespace distill::ipc::sys
