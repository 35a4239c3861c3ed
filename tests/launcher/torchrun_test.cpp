// Plain torchrun (the torch wheel's torch.distributed.run, --no-python) runs a
// distill job: 2 students and the teacher (this binary in the `trun` role,
// teacher.kind self) on one node. The node's segment is made by whichever
// local process comes first and removed by the teacher at the end; a killed
// student fails the attempt, and torchrun's --max-restarts starts a clean one
// (a new segment, a new store prefix); a segment left by a failed job is
// removed by the next job.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <string>

#include "distill/distill.h"
#include "distill/ipc/segment.h"
#include "distill/ipc/torchrun.h"
#include "support/doubler.h"
#include "support/process.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

constexpr int kSteps = 6, kAcc = 2;

distill::Session initSession() {
  int argc = 1;
  char arg0[] = "torchrun_test";
  char* argv[] = {arg0, nullptr};
  return distill::init(argc, argv); // DISTILL_CONFIG names the config
}

int attempt() {
  const char* v = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return v ? std::atoi(v) : -1;
}

} // namespace

// args[0]: ok | kill-once (student 1 SIGKILLs itself at step 3 of attempt 0) |
// kill-always (at step 3 of every attempt).
DISTILL_TEST_ROLE(trun) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = args.at(0);
  distill::Session s = initSession();
  if (s.isTeacher()) {
    std::printf("SEGMENT %s attempt %d\n", s.topology.segment.c_str(), attempt());
    auto stats = distill::serve(*s.teacher, doublerTeacher());
    std::printf("SERVED %lld attempt %d\n", static_cast<long long>(stats.requests), attempt());
    return 0;
  }
  const int rank = s.student->rank();
  int answers = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    const bool die = mode == "kill-always" || (mode == "kill-once" && attempt() == 0);
    if (die && rank == 1 && step == 3) {
      std::printf("KILLING student 1 at step 3 attempt %d\n", attempt());
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    answers += distill::testing::doublerStep(*s.client, rank, step, kAcc);
    s.student->group().barrier("step");
  }
  std::printf("ANSWERS rank=%d n=%d of %d attempt %d\n", rank, answers, kSteps * kAcc, attempt());
  s.client->finish();
  return 0;
}

namespace {

class TorchrunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = "/tmp/" + uniqueName("distill-torchrun");
    ASSERT_EQ(::mkdir(dir_.c_str(), 0700), 0);
    config_ = dir_ + "/job.yaml";
    std::ofstream(config_) << "run:\n  name: torchrun-test\n  startup_timeout_s: 30\n  collective_timeout_s: 30\n"
                           << "  hang_timeout_s: 30\nteacher:\n  kind: self\nstudent:\n  grad_acc_steps: 2\n"
                           << "transport:\n  heartbeat_ms: 200\n";
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  // torchrun --standalone (a free port of its own) with 3 processes; the console in a file.
  std::string run(const std::string& mode, int maxRestarts, ExitStatus& st) {
    const std::string log = dir_ + "/torchrun-" + mode + "-" + std::to_string(runs_++) + ".log";
    Child c = spawn({DISTILL_TEST_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                     "--max-restarts", std::to_string(maxRestarts), "--monitor-interval", "0.1", "--no-python",
                     selfExe(), "--distill-role=trun", mode},
                    {{"DISTILL_CONFIG", config_}, {"OMP_NUM_THREADS", "1"}}, log);
    st = c.join(std::chrono::seconds(120));
    return readFile(log);
  }

  static std::vector<std::string> segments(const std::string& text) {
    std::vector<std::string> out;
    std::regex re("SEGMENT (distill-[0-9a-f]+-r[0-9]+-n0) attempt");
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) out.push_back((*it)[1]);
    return out;
  }

  std::string dir_, config_;
  int runs_ = 0;
};

TEST_F(TorchrunTest, RunsTheJobAndTheTeacherRemovesTheSegment) {
  ExitStatus st;
  const std::string text = run("ok", 0, st);
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << text;
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(text.find("ANSWERS rank=" + std::to_string(r) + " n=12 of 12 attempt 0"), std::string::npos) << text;
  EXPECT_NE(text.find("SERVED 24 attempt 0"), std::string::npos) << text;
  const auto segs = segments(text);
  ASSERT_EQ(segs.size(), 1u) << text;
  EXPECT_FALSE(distill::ipc::Segment::exists(segs[0])) << segs[0] << " left in /dev/shm";
}

// torchrun --max-restarts 1: student 1 is SIGKILLed in attempt 0; torchrun
// stops the others and starts attempt 1, a clean job on a segment of its own
// (attempt 0's removed), which finishes.
TEST_F(TorchrunTest, KilledStudentAndMaxRestartsStartACleanJob) {
  ExitStatus st;
  const std::string text = run("kill-once", 1, st);
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << text;
  EXPECT_NE(text.find("KILLING student 1 at step 3 attempt 0"), std::string::npos) << text;
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(text.find("ANSWERS rank=" + std::to_string(r) + " n=12 of 12 attempt 1"), std::string::npos) << text;
  EXPECT_NE(text.find("SERVED 24 attempt 1"), std::string::npos) << text;
  const auto segs = segments(text);
  ASSERT_EQ(segs.size(), 2u) << text;
  EXPECT_NE(segs[0], segs[1]);
  EXPECT_NE(segs[1].find("-r1-n0"), std::string::npos) << segs[1];
  for (auto& s : segs) EXPECT_FALSE(distill::ipc::Segment::exists(s)) << s << " left in /dev/shm";
}

// Without restarts the job fails (no hang: torchrun stops the survivors, whose
// waits on the dead student end at its death); the segment it leaves is
// removed by the next job on the node, whose creator check finds torchrun gone.
TEST_F(TorchrunTest, KilledStudentFailsTheJobAndTheNextJobRemovesItsSegment) {
  ExitStatus st;
  const std::string failed = run("kill-always", 0, st);
  EXPECT_TRUE(st.exited && st.code != 0) << st.describe() << "\n" << failed;
  EXPECT_NE(failed.find("KILLING student 1 at step 3 attempt 0"), std::string::npos) << failed;
  const auto left = segments(failed);
  ASSERT_EQ(left.size(), 1u) << failed;
  const std::string text = run("ok", 0, st);
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << text;
  EXPECT_FALSE(distill::ipc::Segment::exists(left[0])) << left[0] << " left in /dev/shm";
}

// Attempt `restart` of a torchrun agent (this test process) whose rendezvous
// gave MASTER_PORT `port`: joins the node's segment and writes its name to `out`.
int joinAttempt(int restart, int port, const std::string& out) {
  ::setenv("TORCHELASTIC_RUN_ID", "restart-test", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(restart).c_str(), 1);
  auto topo = distill::Topology::forLocalRank(0, 1, 0, 3);
  topo.torchrun = true;
  topo.masterAddr = "127.0.0.1";
  topo.masterPort = port;
  distill::Config cfg;
  cfg.transport.max_response_bytes = 1 << 20;
  distill::ipc::joinTorchrunSegment(topo, cfg);
  std::ofstream(out) << topo.segment;
  return 0;
}

// A restart's rendezvous may choose a new MASTER_PORT: the next attempt still
// finds and removes the killed attempt's segment (it outlived the job before).
TEST(TorchrunNames, ARestartWithANewPortRemovesTheEarlierAttemptsSegment) {
  const std::string out = "/tmp/distill-trun-" + std::to_string(::getpid());
  auto first = distill::testing::forkChild([&] { return joinAttempt(0, 31111, out + "-0"); });
  ASSERT_EQ(first.join(std::chrono::seconds(30)).code, 0);
  const std::string seg0 = readFile(out + "-0");
  ASSERT_TRUE(distill::ipc::Segment::exists(seg0)) << seg0;
  auto second = distill::testing::forkChild([&] { return joinAttempt(1, 32222, out + "-1"); });
  ASSERT_EQ(second.join(std::chrono::seconds(30)).code, 0);
  const std::string seg1 = readFile(out + "-1");
  EXPECT_FALSE(distill::ipc::Segment::exists(seg0)) << seg0 << " of attempt 0 outlived attempt 1";
  distill::ipc::Segment::remove(seg1);
  std::remove((out + "-0").c_str());
  std::remove((out + "-1").c_str());
}

TEST(TorchrunNames, EveryAttemptAndNodeHasItsOwnSegment) {
  using distill::ipc::torchrunSegmentName;
  const std::string a = torchrunSegmentName("none", 100, "127.0.0.1", 0, 0);
  EXPECT_EQ(a, torchrunSegmentName("none", 100, "127.0.0.1", 0, 0));
  std::set<std::string> all = {a,
                               torchrunSegmentName("none", 100, "127.0.0.1", 1, 0),
                               torchrunSegmentName("none", 100, "127.0.0.1", 0, 1),
                               torchrunSegmentName("none", 101, "127.0.0.1", 0, 0),
                               torchrunSegmentName("other", 100, "127.0.0.1", 0, 0),
                               torchrunSegmentName("none", 100, "127.0.0.2", 0, 0)};
  EXPECT_EQ(all.size(), 6u);
  EXPECT_TRUE(std::regex_match(a, std::regex("distill-[0-9a-f]{12}-r0-n0"))) << a;
}

} // namespace
