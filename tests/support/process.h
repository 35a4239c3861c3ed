#pragma once

// Real child processes for multi-process tests.
//
// forkChild() runs a lambda in a forked child: use it only before anything in
// the test process initialised CUDA (a forked child of a CUDA process cannot
// use CUDA). spawn() fork+execs a binary — the way to start anything that may
// touch CUDA, and how tests re-execute their own binary in a role.
//
// A Child that goes out of scope while still running is SIGKILLed and reaped,
// so a failing test never leaves processes behind.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distill/core/sys.h"

namespace distill::testing {

struct ExitStatus {
  bool exited = false; // normal exit
  int code = -1; // exit code when exited
  int signal = 0; // terminating signal otherwise
  std::string describe() const;
};

class Child {
 public:
  Child() = default;
  explicit Child(pid_t pid) : pid_(pid) {}
  Child(Child&& o) noexcept : pid_(o.pid_), status_(o.status_) { o.pid_ = -1; }
  Child& operator=(Child&& o) noexcept;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child();

  pid_t pid() const { return pid_; }
  void kill(int sig) const;
  // Waits up to `timeout` for the child to end; nullopt if it is still running.
  std::optional<ExitStatus> waitFor(std::chrono::milliseconds timeout);
  // Waits up to `timeout`; on expiry SIGKILLs the child and fails the test.
  ExitStatus join(std::chrono::milliseconds timeout = std::chrono::seconds(60));

 private:
  pid_t pid_ = -1;
  std::optional<ExitStatus> status_;
};

// Runs `body` in a forked child; its return value is the exit code. An
// exception in the child is printed to stderr and becomes exit code 99.
Child forkChild(const std::function<int()>& body);

// fork+exec of argv with the current environment plus `env` (overrides).
// stdout/stderr go to `logPath` when given, else are inherited.
Child spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
            const std::string& logPath = {});

// A name unique to this process and call, e.g. "distill-test-1234-7".
std::string uniqueName(const std::string& prefix = "distill-test");

// A free TCP port on 127.0.0.1 (bound then released; good enough for tests).
int freePort();

// A socket listening on 127.0.0.1 at a port the kernel picked: a stranger on
// that port for as long as the returned Fd lives. .second is the port.
std::pair<distill::Fd, int> listeningStranger();

// Path of a file in the build's bin/ (DISTILL_BIN_DIR, set by ctest).
std::string binPath(const std::string& name);
// Path under the source tree (DISTILL_SOURCE_DIR, set by ctest).
std::string sourcePath(const std::string& rel);

// In a child role: blocks until SIGTERM arrives or `timeout` passes (true on
// SIGTERM). For a process that must stay alive, doing nothing, until told.
bool waitForSigterm(std::chrono::seconds timeout);

// Reads a whole file ("" if missing).
std::string readFile(const std::string& path);

} // namespace distill::testing
