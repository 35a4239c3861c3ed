#pragma once

// Shared by the demo tests: a tiny demo config in a fresh folder, and a
// command whose console (stdout + stderr) is read through a pipe, so that every
// wait is on its output or its exit, with a deadline.

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "demo_support.h"
#include "support/process.h"

namespace distill::testing::demo {

using Ms = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// A folder under /tmp with a tiny demo config (1-layer models, context 16,
// README.md as the data). Removed by the destructor unless the test failed.
struct TinyDemo {
  std::string dir, config, logDir, weights;

  explicit TinyDemo(const std::string& teacherSection = "") {
    dir = "/tmp/" + uniqueName("distill-demo-test");
    examples::makeDirs(dir);
    config = dir + "/tiny.yaml";
    logDir = dir + "/logs";
    weights = dir + "/teacher.pt";
    std::ostringstream y;
    y << "run: {name: demo-test, nproc_per_node: 3, steps: 20, seed: 3, log_dir: " << logDir
      << ", master_port: " << freePort() << ", startup_timeout_s: 30, collective_timeout_s: 30, hang_timeout_s: 30}\n"
      << (teacherSection.empty() ? "teacher: {kind: registered, module: gpt, weights: " + weights +
                  ", threads: 1, library: " + binPath("../lib/libdistill_gpt_teacher.so") +
                  ", cache: {path: " + logDir + "/teacher_cache, mode: write, max_bytes: 64MiB}}\n"
                                 : teacherSection)
      << "loss: {kind: forward_kl, temperature: 1.0, alpha: 0.5}\n" // demo.sh's 2nd student: 2.0
      << "checkpoint: {dir: " << logDir << "/distilled/checkpoints, every_steps: 5, keep_last: 2}\n"
      << "trainer:\n"
      << "  data: " << sourcePath("README.md") << "\n"
      << "  context: 16\n  batch: 4\n  warmup: 5\n  eval_every: 10\n  eval_tokens: 256\n  log_every: 10\n"
      << "  student_layers: 1\n  student_heads: 2\n  student_dim: 16\n"
      << "  teacher_layers: 1\n  teacher_heads: 2\n  teacher_dim: 32\n  teacher_dropout: 0\n"
      << "  teacher_steps: 20\n  teacher_batch: 8\n  teacher_weights: " << weights << "\n"
      << "  threads: 1\n  threads_alone: 1\n";
    std::ofstream(config) << y.str();
  }
  ~TinyDemo() {
    if (!::testing::Test::HasFailure()) examples::removeTree(dir);
  }
  std::string phaseFile(const std::string& phase, const std::string& file) const {
    return logDir + "/" + phase + "/" + file;
  }
};

// A command with its console read through a pipe.
class Console {
 public:
  explicit Console(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {}) {
    int fds[2];
    EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      ::execvp(cargv[0], cargv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    out_ = fds[0];
    child_ = Child(pid);
  }
  ~Console() {
    if (out_ >= 0) ::close(out_);
  }

  pid_t pid() const { return child_.pid(); }
  const std::string& text() const { return text_; }

  // Reads until the console holds `needle` (true), or EOF / `timeout` (false).
  bool waitFor(const std::string& needle, Ms timeout) {
    const auto deadline = SteadyClock::now() + timeout;
    while (text_.find(needle) == std::string::npos) {
      if (!readSome(deadline)) return false;
    }
    return true;
  }

  // Reads to EOF and reaps the command, both within `timeout`.
  ExitStatus finish(Ms timeout) {
    const auto deadline = SteadyClock::now() + timeout;
    while (readSome(deadline)) {
    }
    const auto left = std::chrono::duration_cast<Ms>(deadline - SteadyClock::now());
    auto st = child_.waitFor(std::max(left, Ms(0)));
    if (!st) {
      ADD_FAILURE() << "still running after the deadline; console so far:\n" << text_;
      return child_.join(Ms(1));
    }
    return *st;
  }

 private:
  bool readSome(SteadyClock::time_point deadline) {
    if (out_ < 0) return false;
    const auto left = std::chrono::duration_cast<Ms>(deadline - SteadyClock::now()).count();
    if (left <= 0) return false;
    pollfd p{out_, POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left));
    if (n <= 0) return n < 0 && errno == EINTR;
    char buf[4096];
    const ssize_t got = ::read(out_, buf, sizeof buf);
    if (got <= 0) {
      if (got < 0 && errno == EINTR) return true;
      ::close(out_);
      out_ = -1;
      return false;
    }
    text_.append(buf, static_cast<size_t>(got));
    return true;
  }

  int out_ = -1;
  Child child_;
  std::string text_;
};

// The records of a metrics.jsonl.
inline std::vector<std::map<std::string, std::string>> readMetrics(const std::string& path) {
  std::vector<std::map<std::string, std::string>> out;
  std::istringstream in(readFile(path));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(examples::parseJson(line));
  }
  return out;
}

} // namespace distill::testing::demo
