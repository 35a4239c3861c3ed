#include "support/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

extern char** environ;

namespace distill::testing {

std::string ExitStatus::describe() const {
  if (exited) return "exit code " + std::to_string(code);
  return std::string("signal ") + std::to_string(signal) + " (" + strsignal(signal) + ")";
}

Child& Child::operator=(Child&& o) noexcept {
  if (this != &o) {
    this->~Child();
    pid_ = o.pid_;
    status_ = o.status_;
    o.pid_ = -1;
  }
  return *this;
}

Child::~Child() {
  if (pid_ > 0 && !status_) {
    ::kill(pid_, SIGKILL);
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
  }
}

void Child::kill(int sig) const {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

std::optional<ExitStatus> Child::waitFor(std::chrono::milliseconds timeout) {
  if (status_) return status_;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // Sleep on a pidfd (readable once the child ends) rather than polling.
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  for (;;) {
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      if (pidfd >= 0) ::close(pidfd);
      ExitStatus s;
      s.exited = WIFEXITED(st);
      s.code = s.exited ? WEXITSTATUS(st) : -1;
      s.signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
      status_ = s;
      return status_;
    }
    if (r < 0 && errno != EINTR) {
      ADD_FAILURE() << "waitpid(" << pid_ << "): " << strerror(errno);
      if (pidfd >= 0) ::close(pidfd);
      return std::nullopt;
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      if (pidfd >= 0) ::close(pidfd);
      return std::nullopt;
    }
    auto leftMs = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(leftMs));
    } else {
      // No pidfd (old kernel): a short bounded sleep between checks.
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<long>(leftMs, 2)));
    }
  }
}

ExitStatus Child::join(std::chrono::milliseconds timeout) {
  auto s = waitFor(timeout);
  if (s) return *s;
  ADD_FAILURE() << "child " << pid_ << " still running after " << timeout.count() << " ms; killing it";
  ::kill(pid_, SIGKILL);
  auto k = waitFor(std::chrono::seconds(10));
  return k ? *k : ExitStatus{};
}

Child forkChild(const std::function<int()>& body) {
  std::cout.flush();
  std::cerr.flush();
  pid_t pid = ::fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork: " << strerror(errno);
    return Child();
  }
  if (pid == 0) {
    int code = 99;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: uncaught exception: %s\n", getpid(), e.what());
    } catch (...) {
      std::fprintf(stderr, "child %d: uncaught non-std exception\n", getpid());
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(code);
  }
  return Child(pid);
}

Child spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& logPath) {
  std::vector<std::string> envStrings;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos && env.count(kv.substr(0, eq))) continue;
    envStrings.push_back(kv);
  }
  for (auto& [k, v] : env) envStrings.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (auto& e : envStrings) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);

  // The child only redirects and execs; forkChild turns a failed exec into 127.
  return forkChild([&] {
    if (!logPath.empty()) {
      int fd = ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
    }
    ::execve(cargv[0], cargv.data(), cenv.data());
    std::fprintf(stderr, "execve(%s): %s\n", cargv[0], strerror(errno));
    return 127;
  });
}

std::string uniqueName(const std::string& prefix) {
  static std::atomic<int> counter{0};
  return prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

std::pair<distill::Fd, int> listeningStranger() {
  distill::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd.get() < 0 || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd.get(), 4) != 0) {
    throw std::runtime_error(std::string("listeningStranger: ") + std::strerror(errno));
  }
  socklen_t len = sizeof a;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  return {std::move(fd), ntohs(a.sin_port)};
}

static std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

std::string binPath(const std::string& name) { return envOr("DISTILL_BIN_DIR", ".") + "/" + name; }

std::string sourcePath(const std::string& rel) { return envOr("DISTILL_SOURCE_DIR", ".") + "/" + rel; }

bool waitForSigterm(std::chrono::seconds timeout) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &set, nullptr);
  // Another signal (e.g. the SIGCONT distill-run sends with its SIGTERM) may
  // end the wait early with EINTR: wait again for what is left.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    timespec ts{static_cast<time_t>(left.count() / 1000000000), static_cast<long>(left.count() % 1000000000)};
    const int sig = ::sigtimedwait(&set, nullptr, &ts);
    if (sig == SIGTERM) return true;
    if (sig < 0 && errno != EINTR) return false;
  }
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

} // namespace distill::testing
