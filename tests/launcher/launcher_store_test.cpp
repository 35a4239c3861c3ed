// The student group's rendezvous store that distill-run serves (group/src/rendezvous.cpp,
// job_store.cpp): its port, its listeners, another user refused, two nodes on one machine
// (a lost node, a lost store host, a node with another secret). Ranks are this binary in the
// `job` role (launcher_test.cpp).

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <sys/stat.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>

#include "balance.h"
#include "console.h"
#include "distill/distill.h"
#include "distill/ipc/segment.h"
#include "job_store.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/process.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

using LauncherTest = LauncherFixture;

// ---- The student group's rendezvous store (issue 14 items 18, 19, 21) ----------------------------

// The port distill-run's store listens on, from its log line.
int storePort(const std::string& text) {
  std::smatch m;
  return std::regex_search(text, m, std::regex("rendezvous store on 127\\.0\\.0\\.1:([0-9]+)")) ? std::stoi(m[1]) : -1;
}

// The local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets
// listening on `port`.
std::vector<std::string> listenersOn(int port) {
  std::vector<std::string> out;
  char hexPort[8];
  std::snprintf(hexPort, sizeof hexPort, "%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream in(readFile(table));
    std::string line;
    std::getline(in, line); // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state;
      f >> slot >> local >> remote >> state;
      if (state == "0A" && local.size() > 5 && local.substr(local.size() - 4) == hexPort)
        out.push_back(local.substr(0, local.find(':')));
    }
  }
  return out;
}

// Issue 14 item 19: a port in use failed only after the ranks started, as
// "cannot serve ... within 120000 ms". distill-run binds the store's port
// itself before anything starts and says the port is in use.
TEST_F(LauncherTest, PortInUseFailsAtOnceNamingThePortAndTheKey) {
  auto [stranger, port] = distill::testing::listeningStranger();
  Launch l({"--config", config(), "--master-port", std::to_string(port), "--", selfExe(), "--distill-role=job", "ok"});
  auto st = l.finish();
  stranger.reset();
  std::printf("port in use -> distill-run exit: %lld ms\n", static_cast<long long>(l.elapsedMs()));
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << l.text();
  EXPECT_TRUE(has(l.text(), "port " + std::to_string(port) + " on 127.0.0.1 is in use (run.master_port)")) << l.text();
  EXPECT_LT(l.elapsedMs(), 10000) << l.text();
  EXPECT_FALSE(has(l.text(), "[r0 student]") || has(l.text(), "segment /dev/shm/")) << "a rank started\n" << l.text();
}

// Issue 14 item 19: run.master_port 0 lets a single-node job pick a free port
// (distill-run binds it and hands the socket to student rank 0: nobody can
// take it in between); a job of several nodes cannot.
TEST_F(LauncherTest, MasterPortZeroPicksAFreePortOnOneNode) {
  Launch l({"--config", config(), "--master-port", "0", "--", selfExe(), "--distill-role=job", "ok"});
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  EXPECT_GT(storePort(l.text()), 0) << l.text();
  EXPECT_TRUE(has(l.text(), "(served by student rank 0; a free port)")) << l.text();
  EXPECT_TRUE(has(l.text(), "[r2 teacher] teacher served 6 requests")) << l.text();

  Launch two({"--nnodes", "2", "--node-rank", "0", "--config", config(2), "--master-port", "0", "--", selfExe(),
              "--distill-role=job", "ok"},
             false, {}, {{"DISTILL_JOB_SECRET", "0123456789abcdef0123"}});
  auto st2 = two.finish();
  EXPECT_TRUE(st2.exited && st2.code == 2) << st2.describe() << "\n" << two.text();
  EXPECT_TRUE(has(two.text(), "run.master_port 0 (a free port) is for single-node jobs")) << two.text();
}

// Issue 14 item 18: the store listened on every interface and any local user
// could connect, read counters and write keys. Now it listens on
// run.master_addr only, and a process of another user (nobody, 65534) can
// neither speak c10d's TCPStore protocol to it (which lists every key) nor
// join with a guessed secret, nor read the secret from a rank's environment;
// the job goes on unaffected.
TEST_F(LauncherTest, AnotherUserCannotReadWriteOrJoinTheStore) {
  const std::string fifo = dir_ + "/go";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Launch l(jobArgs({}, {"hold", fifo}));
  ASSERT_TRUE(l.waitFor("READY student 0") && l.waitFor("READY student 1")) << l.text();
  const int port = storePort(l.text());
  ASSERT_GT(port, 0) << l.text();
  std::smatch m;
  const std::string text = l.text();
  ASSERT_TRUE(std::regex_search(text, m, std::regex("READY student 0 pid ([0-9]+)"))) << text;
  const std::string student0 = m[1];

  const auto listeners = listenersOn(port);
  EXPECT_EQ(listeners, std::vector<std::string>{"0100007F"}) << "listening on every interface, or not at all";

  auto stranger = forkChild([&] {
    if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
    int code = 0;
    // c10d's own client, as the stranger used it: refused at its first byte.
    try {
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(port);
      o.isServer = false;
      o.timeout = std::chrono::seconds(2);
      c10d::TCPStore tcp("127.0.0.1", o);
      auto keys = tcp.listKeys();
      std::fprintf(stderr, "stranger: TCPStore listed %zu keys\n", keys.size());
      tcp.set("distill/students/joined", std::vector<uint8_t>{'9'});
      code |= 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "stranger: TCPStore refused: %.200s\n", e.what());
    }
    // distill's client with a guessed secret (or none): refused.
    for (const std::string guess : {"0123456789abcdef0123456789abcdef", ""}) {
      try {
        distill::JobStore js("127.0.0.1", port, guess, 1, "student rank 0 on node 0",
                             distill::Deadline::after(std::chrono::seconds(5)));
        js.set("distill/students/joined", std::vector<uint8_t>{'9'});
        code |= 2;
      } catch (const distill::ConfigError& e) {
        std::fprintf(stderr, "stranger: JobStore refused: %s\n", e.what());
        if (!has(e.what(), "refused this process: it does not hold the job's secret")) code |= 4;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "stranger: JobStore failed otherwise: %s\n", e.what());
        code |= 8;
      }
    }
    // The secret, where distill-run put it: environ is its own user's only.
    if (!readFile("/proc/" + student0 + "/environ").empty()) code |= 16;
    return code;
  });
  const auto st = stranger.join(std::chrono::seconds(60));
  EXPECT_TRUE(st.exited && st.code == 0)
      << st.describe() << " (1: TCPStore worked, 2: joined with a guess, 4/8: other error, 16: read environ)";

  // The job is unaffected.
  int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "g", 1), 1);
  ::close(fd);
  auto done = l.finish();
  EXPECT_TRUE(done.exited && done.code == 0) << done.describe() << "\n" << l.text();
  EXPECT_TRUE(has(l.text(), "HELD student 0") && has(l.text(), "HELD student 1")) << l.text();
  EXPECT_TRUE(has(l.text(), "refused a connection from 127.0.0.1:")) << l.text();
  EXPECT_TRUE(has(l.text(), "it did not prove the job secret")) << l.text();
  expectSegmentGone(l);
}

// The first line of `text` that holds `needle` ("" if none).
std::string lineWith(const std::string& text, const std::string& needle) {
  const size_t at = text.find(needle);
  if (at == std::string::npos) return "";
  const size_t from = text.rfind('\n', at);
  const size_t to = text.find('\n', at);
  return text.substr(from == std::string::npos ? 0 : from + 1,
                     to == std::string::npos ? std::string::npos : to - from - 1);
}

class TwoNodeTest : public LauncherFixture {
 protected:
  // Two nodes on 127.0.0.1, 2 students + 1 teacher each, in `mode`.
  void start(const std::string& mode, const std::string& secret1 = kSecret, const std::vector<std::string>& more = {}) {
    const std::string port = std::to_string(freePort());
    const std::string cfg = config(3);
    for (int k = 0; k < 2; ++k) {
      std::vector<std::string> args{"--nproc-per-node", "3",
                                    "--nnodes",         "2",
                                    "--node-rank",      std::to_string(k),
                                    "--master-addr",    "127.0.0.1",
                                    "--master-port",    port,
                                    "--config",         cfg,
                                    "--log-dir",        dir_ + "/logs" + std::to_string(k)};
      args.insert(args.end(), more.begin(), more.end());
      args.insert(args.end(), {"--", selfExe(), "--distill-role=job", mode});
      nodes_[k] = std::make_unique<Launch>(
          args, false, std::vector<std::string>{},
          std::map<std::string, std::string>{{"DISTILL_JOB_SECRET", k == 0 ? kSecret : secret1}});
    }
  }
  // The pid a student printed in its READY line, from node `k`'s console.
  int pidOf(int k, int studentRank) {
    const std::string label = "READY student " + std::to_string(studentRank) + " pid ";
    if (!nodes_[k]->waitFor(label)) return -1;
    std::smatch m;
    const std::string t = nodes_[k]->text();
    return std::regex_search(t, m, std::regex(label + "([0-9]+)")) ? std::stoi(m[1]) : -1;
  }

  static constexpr const char* kSecret = "one-job-on-two-nodes-0123456789abcdef";
  std::unique_ptr<Launch> nodes_[2];
};

// Issue 14 item 21: node 1's student killed: node 0 said "every student rank
// entered it; a peer failed inside it" or named the ranks torn down with it.
// The store saw the killed rank's connection close first: node 0 names it.
TEST_F(TwoNodeTest, KilledStudentOfNodeOneIsNamedLostFirstOnNodeZero) {
  start("collect");
  for (int r : {0, 1}) ASSERT_GT(pidOf(0, r), 0) << nodes_[0]->text();
  ASSERT_GT(pidOf(1, 3), 0) << nodes_[1]->text();
  const int victim = pidOf(1, 2);
  ASSERT_GT(victim, 0) << nodes_[1]->text();
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto s0 = nodes_[0]->finish(), s1 = nodes_[1]->finish();
  const std::string& t0 = nodes_[0]->text();
  EXPECT_TRUE(s0.exited && s0.code == 1) << s0.describe() << "\n" << t0;
  EXPECT_TRUE(s1.exited && s1.code == 1) << s1.describe() << "\n" << nodes_[1]->text();
  EXPECT_TRUE(has(t0, "student rank 2 (r3 on node 1) was lost first")) << t0;
  EXPECT_TRUE(has(t0, "job failed: [r3 student] on node 1 was lost first (its node's distill-run says how); here [r")) << t0;
  std::printf("node 0 says: %s\n", lineWith(t0, "was lost first").c_str());
  EXPECT_FALSE(has(t0, "every student rank entered it; a peer failed inside it")) << t0;
  EXPECT_TRUE(has(nodes_[1]->text(), "job failed: [r3 student] signal SIGKILL")) << nodes_[1]->text();
  expectSegmentGone(*nodes_[0]);
  expectSegmentGone(*nodes_[1]);
}

// Issue 14 item 21: when the store's host died, the others said "Did the
// remote server shutdown or crash?". Now they name the store's host.
TEST_F(TwoNodeTest, LostStoreHostIsNamedOnTheOtherNode) {
  start("collect");
  for (int r : {2, 3}) ASSERT_GT(pidOf(1, r), 0) << nodes_[1]->text();
  ASSERT_GT(pidOf(0, 1), 0) << nodes_[0]->text();
  const int host = pidOf(0, 0);
  ASSERT_GT(host, 0) << nodes_[0]->text();
  ASSERT_EQ(::kill(host, SIGKILL), 0);
  auto s0 = nodes_[0]->finish(), s1 = nodes_[1]->finish();
  const std::string& t1 = nodes_[1]->text();
  EXPECT_TRUE(s1.exited && s1.code == 1) << s1.describe() << "\n" << t1;
  EXPECT_TRUE(has(t1, "the rendezvous store's host, student rank 0 (node 0) at 127.0.0.1:")) << t1;
  std::printf("node 1 says: %s\n", lineWith(t1, "the rendezvous store's host").c_str());
  EXPECT_FALSE(has(t1, "Did the remote server shutdown or crash")) << t1;
  EXPECT_TRUE(s0.exited && s0.code == 1) << s0.describe() << "\n" << nodes_[0]->text();
  EXPECT_TRUE(has(nodes_[0]->text(), "job failed: [r0 student] signal SIGKILL")) << nodes_[0]->text();
}

// Issue 14 item 18: the nodes of one job share its secret; a node given
// another secret is refused by the store, and says so.
TEST_F(TwoNodeTest, NodeWithAnotherSecretIsRefused) {
  start("ok", "another-jobs-secret-0123456789abcdef", {"--set", "run.startup_timeout_s=5"});
  auto s0 = nodes_[0]->finish(), s1 = nodes_[1]->finish();
  const std::string& t1 = nodes_[1]->text();
  EXPECT_TRUE(s1.exited && s1.code == 1) << s1.describe() << "\n" << t1;
  EXPECT_TRUE(has(t1, "refused this process: it does not hold the job's secret")) << t1;
  EXPECT_TRUE(s0.exited && s0.code == 1) << s0.describe() << "\n" << nodes_[0]->text();
  EXPECT_TRUE(has(nodes_[0]->text(), "it did not prove the job secret")) << nodes_[0]->text();
}

} // namespace
