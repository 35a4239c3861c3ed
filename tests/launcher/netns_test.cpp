// Two nodes that are really two: each node's distill-run runs in a network and
// mount namespace of its own, made here (a veth pair between them, addresses
// private to the namespaces, each node its own /dev/shm). A job runs to the
// end; a killed node-1 student is named first on node 0; no rank listens on an
// address the job did not give it (no wildcard, only the node's own address
// on the job's network, or loopback). Needs root and iproute2; skipped with
// the reason where namespaces or veth pairs cannot be made.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "distill/distill.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/process.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {
const char* kAddr[2] = {"10.231.7.1", "10.231.7.2"}; // private to the test's namespaces
const char* kDev[2] = {"dstl0", "dstl1"};
} // namespace

// args: node (0/1), gate FIFO, then distill-run's path and arguments. Makes
// this process's own network and mount namespaces (loopback up, a private
// tmpfs on /dev/shm), prints "NETNS READY <node> pid <pid>", waits for the
// test to move its end of the veth pair in (the gate), gives it its address
// and execs distill-run there.
DISTILL_TEST_ROLE(netns_node) {
  const int node = std::stoi(args.at(0));
  const std::string gate = args.at(1);
  if (::unshare(CLONE_NEWNET | CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
      ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=256m,mode=1777") != 0) {
    std::printf("SKIP: no network/mount namespace here: %s\n", std::strerror(errno));
    return 77;
  }
  if (std::system("ip link set lo up") != 0) {
    std::printf("SKIP: ip link set lo up failed\n");
    return 77;
  }
  std::printf("NETNS READY %d pid %d\n", node, static_cast<int>(::getpid()));
  std::fflush(stdout);
  const int fd = ::open(gate.c_str(), O_RDONLY);
  char c = 0;
  if (fd < 0 || ::read(fd, &c, 1) != 1 || c != 'g') return 76; // the test could not make the veth pair
  ::close(fd);
  const std::string up = std::string("ip addr add ") + kAddr[node] + "/24 dev " + kDev[node] + " && ip link set " +
      kDev[node] + " up";
  if (std::system(up.c_str()) != 0) {
    std::printf("cannot configure %s\n", kDev[node]);
    return 75;
  }
  std::vector<char*> argv;
  for (size_t i = 2; i < args.size(); ++i) argv.push_back(const_cast<char*>(args[i].c_str()));
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  std::printf("cannot exec %s: %s\n", argv[0], std::strerror(errno));
  return 127;
}

// args[0] = mode. steps: 20 steps (ask the teacher, all-reduce), "RESULT <sum>".
// hold: "READY student <rank> pid <pid>" after the first step, then steps until 60 s pass.
DISTILL_TEST_ROLE(node_job) {
  const std::string mode = args.at(0);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int argc = 1;
  char arg0[] = "netns_test";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  if (s.isTeacher()) {
    distill::serve(*s.teacher, doublerTeacher());
    return 0;
  }
  const int rank = s.topology.studentRank;
  auto sum = torch::zeros({1}, torch::kDouble);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int64_t step = 0; mode == "hold" ? std::chrono::steady_clock::now() < end : step < 20; ++step) {
    doublerStep(*s.client, rank, step, 1);
    auto t = torch::full({1}, double(rank + step), torch::kDouble);
    s.student->group().allReduce(t, distill::ReduceOp::kSum, "sum");
    sum += t;
    if (step == 0) std::printf("READY student %d pid %d\n", rank, static_cast<int>(::getpid()));
  }
  s.client->finish();
  std::printf("RESULT %.1f\n", sum.item<double>());
  return 0;
}

namespace {

// Listening TCP sockets of the network namespace of `pid`, as "a.b.c.d:port".
std::set<std::string> listeners(int pid) {
  std::set<std::string> out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/net/tcp");
  std::string line;
  std::getline(f, line); // header
  while (std::getline(f, line)) {
    std::istringstream is(line);
    std::string sl, local, remote, st;
    is >> sl >> local >> remote >> st;
    if (st != "0A") continue; // LISTEN
    const unsigned addr = std::stoul(local.substr(0, 8), nullptr, 16); // little-endian on x86
    const unsigned port = std::stoul(local.substr(9), nullptr, 16);
    char text[32];
    std::snprintf(text, sizeof text, "%u.%u.%u.%u:%u", addr & 255, (addr >> 8) & 255, (addr >> 16) & 255, addr >> 24,
                  port);
    out.insert(text);
  }
  std::ifstream f6("/proc/" + std::to_string(pid) + "/net/tcp6");
  std::getline(f6, line);
  while (std::getline(f6, line)) {
    std::istringstream is(line);
    std::string sl, local, remote, st;
    is >> sl >> local >> remote >> st;
    if (st == "0A") out.insert("[v6]" + local);
  }
  return out;
}

class NetnsTwoNodes : public LauncherFixture {
 protected:
  void SetUp() override {
    LauncherFixture::SetUp();
    if (::geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces";
    if (std::system("command -v ip >/dev/null 2>&1") != 0) GTEST_SKIP() << "needs iproute2 (ip)";
  }

  // Starts both nodes in `mode`; false (with skipReason_) when the namespaces
  // or the veth pair cannot be made here.
  bool start(const std::string& mode) {
    const std::string port = std::to_string(freePort());
    const std::string cfg = config(3);
    std::string gates[2];
    for (int k = 0; k < 2; ++k) {
      gates[k] = dir_ + "/gate" + std::to_string(k);
      ::unlink(gates[k].c_str());
      EXPECT_EQ(::mkfifo(gates[k].c_str(), 0600), 0);
      std::vector<std::string> args{"--nproc-per-node", "3", "--nnodes", "2", "--node-rank", std::to_string(k),
                                    "--master-addr", kAddr[0], "--master-port", port, "--config", cfg,
                                    "--set", "transport.max_response_bytes=1MiB", "--log-dir",
                                    dir_ + "/logs" + std::to_string(k), "--", selfExe(), "--distill-role=node_job",
                                    mode};
      nodes_[k] = std::make_unique<Launch>(
          args, false, std::vector<std::string>{selfExe(), "--distill-role=netns_node", std::to_string(k), gates[k]},
          std::map<std::string, std::string>{{"DISTILL_JOB_SECRET", "two-namespaces-0123456789abcdef"}});
    }
    int pids[2];
    for (int k = 0; k < 2; ++k) {
      const std::string label = "NETNS READY " + std::to_string(k) + " pid ";
      if (!nodes_[k]->waitFor(label, Ms(30000))) {
        skipReason_ = nodes_[k]->text();
        return false;
      }
      std::smatch m;
      const std::string t = nodes_[k]->text();
      std::regex_search(t, m, std::regex(label + "([0-9]+)"));
      pids[k] = std::stoi(m[1]);
    }
    const std::string veth = std::string("ip link add ") + kDev[0] + " netns " + std::to_string(pids[0]) +
        " type veth peer name " + kDev[1] + " netns " + std::to_string(pids[1]);
    const bool made = std::system(veth.c_str()) == 0;
    for (int k = 0; k < 2; ++k) {
      const int fd = ::open(gates[k].c_str(), O_WRONLY);
      EXPECT_GE(fd, 0);
      EXPECT_EQ(::write(fd, made ? "g" : "n", 1), 1);
      ::close(fd);
    }
    if (!made) skipReason_ = "cannot make a veth pair here (" + veth + ")";
    return made;
  }
  int pidOf(int k, int studentRank) {
    const std::string label = "READY student " + std::to_string(studentRank) + " pid ";
    if (!nodes_[k]->waitFor(label, Ms(60000))) return -1;
    std::smatch m;
    const std::string t = nodes_[k]->text();
    return std::regex_search(t, m, std::regex(label + "([0-9]+)")) ? std::stoi(m[1]) : -1;
  }

  std::unique_ptr<Launch> nodes_[2];
  std::string skipReason_;
};

TEST_F(NetnsTwoNodes, AJobRunsToTheEnd) {
  if (!start("steps")) GTEST_SKIP() << skipReason_;
  for (int k = 0; k < 2; ++k) {
    const auto st = nodes_[k]->finish(Ms(120000));
    EXPECT_TRUE(st.exited && st.code == 0) << "node " << k << ": " << st.describe() << "\n" << nodes_[k]->text();
  }
  // 20 steps of sum over 4 students of (rank + step): 4 x 190 + 20 x 6 = 880.
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(has(nodes_[k]->text(), "RESULT 880.0")) << nodes_[k]->text();
}

TEST_F(NetnsTwoNodes, NoWildcardListenersAndAKilledNodeOneStudentIsNamedFirst) {
  if (!start("hold")) GTEST_SKIP() << skipReason_;
  const int host = pidOf(0, 0), victim = pidOf(1, 2);
  ASSERT_GT(host, 0) << nodes_[0]->text();
  ASSERT_GT(victim, 0) << nodes_[1]->text();
  ASSERT_GT(pidOf(1, 3), 0) << nodes_[1]->text();
  for (int k = 0; k < 2; ++k) {
    const int pid = k == 0 ? host : victim;
    for (const auto& l : listeners(pid)) {
      const bool mine = l.rfind(std::string(kAddr[k]) + ":", 0) == 0 || l.rfind("127.", 0) == 0;
      EXPECT_TRUE(mine) << "node " << k << " listens on " << l << " (the job names " << kAddr[0] << " as master, "
                        << kAddr[k] << " is the node's own address)";
    }
  }
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto s0 = nodes_[0]->finish(Ms(60000)), s1 = nodes_[1]->finish(Ms(60000));
  const std::string& t0 = nodes_[0]->text();
  EXPECT_TRUE(s0.exited && s0.code == 1) << s0.describe() << "\n" << t0;
  EXPECT_TRUE(s1.exited && s1.code == 1) << s1.describe() << "\n" << nodes_[1]->text();
  EXPECT_TRUE(has(t0, "student rank 2 (r3 on node 1) was lost first")) << t0;
  EXPECT_TRUE(has(t0, "job failed: [r3 student] on node 1 was lost first (its node's distill-run says how); here [r")) << t0;
  EXPECT_TRUE(has(nodes_[1]->text(), "job failed: [r3 student] signal SIGKILL")) << nodes_[1]->text();
  EXPECT_FALSE(has(nodes_[1]->text(), "SIGPIPE")) << nodes_[1]->text();
}

} // namespace
