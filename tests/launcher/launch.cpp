#include "launch.h"

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>

#include "distill/ipc/segment.h"
#include "support/roles.h"

extern char** environ;

namespace distill::testing {

bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

Launch::Launch(const std::vector<std::string>& args, bool tty, const std::vector<std::string>& wrapper,
               const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv = wrapper;
  argv.push_back(binPath("distill-run"));
  argv.insert(argv.end(), args.begin(), args.end());
  int fds[2];
  if (tty) {
    EXPECT_EQ(::openpty(&fds[0], &fds[1], nullptr, nullptr, nullptr), 0);
    ::fcntl(fds[0], F_SETFD, FD_CLOEXEC);
    ::fcntl(fds[1], F_SETFD, FD_CLOEXEC);
  } else {
    EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  }
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  std::vector<std::string> envs; // built before the fork: the child only execs
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    if (!env.count(kv.substr(0, kv.find('=')))) envs.push_back(kv);
  }
  for (auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> cenv;
  for (auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  out_ = fds[0];
  child_ = Child(pid);
  started_ = SteadyClock::now();
}

Launch::~Launch() {
  if (out_ >= 0) ::close(out_);
}

bool Launch::waitFor(const std::string& needle, Ms timeout) {
  const auto deadline = SteadyClock::now() + timeout;
  while (text_.find(needle) == std::string::npos) {
    if (!readSome(deadline)) return false;
  }
  return true;
}

ExitStatus Launch::finish(Ms timeout) {
  const auto deadline = SteadyClock::now() + timeout;
  while (readSome(deadline)) {
  }
  auto left = std::chrono::duration_cast<Ms>(deadline - SteadyClock::now());
  auto st = child_.waitFor(std::max(left, Ms(0)));
  if (!st) {
    ADD_FAILURE() << "distill-run still running; console so far:\n" << text_;
    return child_.join(Ms(1));
  }
  elapsed_ = msSince(started_);
  return *st;
}

std::string Launch::segment() const {
  std::smatch m;
  return std::regex_search(text_, m, std::regex("segment /dev/shm/(distill-[0-9a-f]+-n[0-9]+)")) ? m[1].str() : "";
}

bool Launch::readSome(SteadyClock::time_point deadline) {
  if (out_ < 0) return false;
  auto left = std::chrono::duration_cast<Ms>(deadline - SteadyClock::now()).count();
  if (left <= 0) return false;
  pollfd p{out_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
  char buf[65536];
  ssize_t n = ::read(out_, buf, sizeof buf);
  if (n <= 0) { // EOF (pipe) or EIO (terminal whose last writer left)
    ::close(out_);
    out_ = -1;
    return false;
  }
  text_.append(buf, static_cast<size_t>(n));
  return true;
}

void LauncherFixture::SetUp() {
  char tmpl[] = "/tmp/distill-launcher-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  dir_ = tmpl;
}

void LauncherFixture::TearDown() { std::system(("rm -rf " + dir_).c_str()); }

std::string LauncherFixture::config(int nproc) {
  std::string path = dir_ + "/job.yaml";
  std::ofstream(path) << "run:\n  name: launcher-test\n  nproc_per_node: " << nproc << "\n  log_dir: " << dir_
                      << "/logs\n  startup_timeout_s: 30\n  collective_timeout_s: 30\n  hang_timeout_s: 30\n"
                      << "teacher:\n  kind: self\n";
  return path;
}

std::vector<std::string> LauncherFixture::jobArgs(const std::vector<std::string>& options,
                                                  const std::vector<std::string>& roleArgs, const std::string& role) {
  std::vector<std::string> a = options;
  a.insert(
      a.end(),
      {"--config", config(), "--master-port", std::to_string(freePort()), "--", selfExe(), "--distill-role=" + role});
  a.insert(a.end(), roleArgs.begin(), roleArgs.end());
  return a;
}

void LauncherFixture::expectSegmentGone(const Launch& l) {
  const std::string seg = l.segment();
  ASSERT_FALSE(seg.empty()) << l.text();
  EXPECT_FALSE(distill::ipc::Segment::exists(seg)) << seg << " left in /dev/shm";
}

std::string LauncherFixture::log(int rank) const {
  return readFile(dir_ + "/logs/rank_" + std::to_string(rank) + ".log");
}

} // namespace distill::testing
