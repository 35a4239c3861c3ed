// The production hang of the checkpoint barrier, as a regression: the students
// run collectives on their own group while the teacher process is alive and
// calls nothing collective. Real processes, the real rendezvous store and gloo group.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <thread>

#include "distill/core/clock.h"
#include "distill/core/context.h"
#include "distill/group/student_context.h"
#include "distill/core/errors.h"
#include "distill/core/trace.h"
#include "distill/group/student_group.h"
#include "support/process.h"
#include "support/roles.h"

using namespace std::chrono;
namespace dt = distill::testing;

namespace {

distill::Config groupConfig(double startupS, double collectiveS) {
  distill::Config c;
  c.run.startup_timeout_s = startupS;
  c.run.collective_timeout_s = collectiveS;
  return c;
}

std::map<std::string, std::string> envFor(int local, int perNode, int port) {
  distill::Topology t = distill::Topology::forLocalRank(0, 1, local, perNode);
  t.masterPort = port;
  auto env = distill::topologyEnv(t);
  env["DISTILL_JOB_SECRET"] = "student-group-test-secret-0123456789"; // as distill-run hands it out
  return env;
}

int exitCodeFor(const std::exception& e) {
  if (dynamic_cast<const distill::TimeoutError*>(&e)) return 3;
  if (dynamic_cast<const distill::PeerLostError*>(&e)) return 4;
  return 5;
}

} // namespace

// args: iterations collective_timeout_s startup_timeout_s mode(run|stall)
DISTILL_TEST_ROLE(student) {
  const int iterations = std::stoi(args.at(0));
  auto config = groupConfig(std::stod(args.at(2)), std::stod(args.at(1)));
  const bool stall = args.at(3) == "stall";
  auto start = steady_clock::now();
  try {
    distill::StudentContext ctx(distill::Topology::fromEnvironment(), config);
    auto& g = ctx.group();
    if (stall) {
      // Joined, then stuck (as in a frozen data loader): never enters a collective.
      return dt::waitForSigterm(seconds(60)) ? 0 : 6;
    }
    const int64_t n = g.size();
    for (int i = 1; i <= iterations; ++i) {
      start = steady_clock::now();
      distill::trace::setCurrentStep(i, 0); // as the student client does per request
      g.barrier("checkpoint barrier");
      auto t = torch::full({4}, static_cast<double>((g.rank() + 1) * i), torch::kFloat64);
      g.allReduce(t, distill::ReduceOp::kSum, "loss all_reduce");
      double expected = static_cast<double>(i) * n * (n + 1) / 2;
      if (!torch::allclose(t, torch::full({4}, expected, torch::kFloat64))) {
        std::fprintf(stderr, "wrong sum at %d: %f vs %f\n", i, t[0].item<double>(), expected);
        return 1;
      }
    }
    std::fprintf(stderr, "RESULT ok %d collectives\n", static_cast<int>(g.sequence()));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR after %lld ms: %s\n", static_cast<long long>(distill::msSince(start)), e.what());
    return exitCodeFor(e);
  }
}

// The teacher: a TeacherContext, alive for the whole run, in no collective.
DISTILL_TEST_ROLE(teacher) {
  distill::TeacherContext ctx(distill::Topology::fromEnvironment(), distill::Config{});
  std::fprintf(stderr, "teacher up: %s\n", ctx.topology().describe().c_str());
  return dt::waitForSigterm(seconds(120)) ? 0 : 7;
}

class StudentGroupTest : public ::testing::Test {
 protected:
  std::string log(int r) { return ::testing::TempDir() + dt::uniqueName("sg") + "-r" + std::to_string(r) + ".log"; }
};

TEST_F(StudentGroupTest, StudentsCollectWhileTeacherNeverJoins) {
  const int port = dt::freePort();
  const int perNode = 4; // 3 students + 1 teacher
  std::vector<std::string> logs;
  std::vector<dt::Child> students;
  for (int r = 0; r < perNode; ++r) logs.push_back(log(r));
  dt::Child teacher = dt::spawnRole("teacher", {}, envFor(3, perNode, port), logs[3]);
  auto start = steady_clock::now();
  for (int r = 0; r < 3; ++r) {
    students.push_back(dt::spawnRole("student", {"100", "30", "30", "run"}, envFor(r, perNode, port), logs[r]));
  }
  for (int r = 0; r < 3; ++r) {
    auto st = students[r].join(seconds(90));
    EXPECT_TRUE(st.exited && st.code == 0) << "student " << r << ": " << st.describe() << "\n" << dt::readFile(logs[r]);
    EXPECT_NE(dt::readFile(logs[r]).find("RESULT ok 200 collectives"), std::string::npos);
  }
  auto took = duration_cast<milliseconds>(steady_clock::now() - start).count();
  // The teacher was alive throughout (it never joined anything, so nothing waited on it).
  EXPECT_FALSE(teacher.waitFor(milliseconds(0))) << dt::readFile(logs[3]);
  teacher.kill(SIGTERM);
  auto ts = teacher.join(seconds(10));
  EXPECT_TRUE(ts.exited && ts.code == 0) << ts.describe() << dt::readFile(logs[3]);
  RecordProperty("elapsed_ms", std::to_string(took));
  EXPECT_LT(took, 30000) << "100 barrier+all_reduce rounds should take seconds";
}

TEST_F(StudentGroupTest, StudentThatNeverEntersTheBarrierIsNamed) {
  const int port = dt::freePort();
  const double timeoutS = 2.0;
  std::vector<std::string> logs{log(0), log(1), log(2)};
  std::vector<dt::Child> kids;
  for (int r = 0; r < 3; ++r) {
    kids.push_back(dt::spawnRole("student", {"5", "2", "30", r == 2 ? "stall" : "run"}, envFor(r, 4, port), logs[r]));
  }
  for (int r = 0; r < 2; ++r) {
    auto st = kids[r].join(seconds(30));
    std::string out = dt::readFile(logs[r]);
    EXPECT_TRUE(st.exited && st.code == 3) << "rank " << r << ": " << st.describe() << "\n" << out;
    EXPECT_NE(out.find("student rank(s) 2 never entered it"), std::string::npos) << out;
    // The collective, its number, the step it was entered at.
    EXPECT_NE(out.find("student group checkpoint barrier #1 timed out"), std::string::npos) << out;
    EXPECT_NE(out.find("[step=1 acc_step=0 awaiting: student group checkpoint barrier #1]"), std::string::npos) << out;
    EXPECT_NE(out.find(" r" + std::to_string(r) + " student]"), std::string::npos) << out;
    // Detected within the deadline (plus slack), measured by the waiter itself.
    auto pos = out.find("ERROR after ");
    ASSERT_NE(pos, std::string::npos) << out;
    long ms = std::stol(out.substr(pos + 12));
    EXPECT_GE(ms, timeoutS * 1000 * 0.9) << out;
    EXPECT_LT(ms, timeoutS * 1000 * 2) << out;
  }
  kids[2].kill(SIGTERM);
  kids[2].join(seconds(10));
}

TEST_F(StudentGroupTest, StudentThatNeverStartsIsNamedAtRendezvous) {
  const int port = dt::freePort();
  std::vector<std::string> logs{log(0), log(1)};
  std::vector<dt::Child> kids;
  // World of 3 students; rank 2 is never started.
  for (int r = 0; r < 2; ++r) {
    kids.push_back(dt::spawnRole("student", {"1", "5", "2", "run"}, envFor(r, 4, port), logs[r]));
  }
  for (int r = 0; r < 2; ++r) {
    auto st = kids[r].join(seconds(30));
    std::string out = dt::readFile(logs[r]);
    EXPECT_TRUE(st.exited && st.code == 3) << st.describe() << "\n" << out;
    EXPECT_NE(out.find("missing student rank(s) 2"), std::string::npos) << out;
  }
}

// Issue 14 item 19: a port in use was reported as "cannot serve the
// rendezvous store within N ms". Student rank 0, started without distill-run,
// binds the store's port itself and says the port is in use, at once.
TEST_F(StudentGroupTest, PortInUseIsNamedAtOnce) {
  auto [stranger, port] = distill::testing::listeningStranger();
  const std::string logPath = log(0);
  auto kid = dt::spawnRole("student", {"1", "5", "30", "run"}, envFor(0, 3, port), logPath);
  auto st = kid.join(seconds(30));
  stranger.reset();
  const std::string out = dt::readFile(logPath);
  EXPECT_TRUE(st.exited && st.code == 5) << st.describe() << " (5: ConfigError)\n" << out;
  EXPECT_NE(out.find("port " + std::to_string(port) + " on 127.0.0.1 is in use (run.master_port)"), std::string::npos)
      << out;
  auto pos = out.find("ERROR after ");
  ASSERT_NE(pos, std::string::npos) << out;
  EXPECT_LT(std::stol(out.substr(pos + 12)), 5000) << out;
}

// GroupNotes between 2 students: a background thread of each posts and awaits
// notes while its main thread runs collectives; a note never posted is nullopt
// at its deadline; once student rank 0 (the store's host) has exited, an await
// is a PeerLostError at once, not at its deadline. Prints "NOTES ..." lines.
DISTILL_TEST_ROLE(notes) {
  auto config = groupConfig(30, 10);
  try {
    distill::StudentContext ctx(distill::Topology::fromEnvironment(), config);
    auto& g = ctx.group();
    const int rank = g.rank();
    auto notes = g.notes("test");
    std::string got, late;
    std::thread helper([&] {
      notes->post("hello/r" + std::to_string(rank), "v" + std::to_string(rank));
      auto v = notes->await({"hello/r0", "hello/r1"}, milliseconds(10000));
      got = v[0].value_or("-") + "," + v[1].value_or("-");
      auto start = steady_clock::now();
      auto none = notes->await({"hello/r0", "never"}, milliseconds(500));
      late = std::string(none[0] ? "r0" : "-") + "," + (none[1] ? *none[1] : "-") + " after " +
          std::to_string(duration_cast<milliseconds>(steady_clock::now() - start).count());
    });
    for (int i = 0; i < 20; ++i) {
      auto t = torch::ones({4});
      g.allReduce(t, distill::ReduceOp::kSum, "main thread");
    }
    helper.join();
    std::fprintf(stderr, "NOTES got %s\nNOTES late %s\n", got.c_str(), late.c_str());
    g.barrier("before rank 0 leaves");
    if (rank == 0) return 0;
    auto start = steady_clock::now();
    try {
      notes->await({"never again"}, milliseconds(30000));
      std::fprintf(stderr, "NOTES no error\n");
    } catch (const distill::PeerLostError& e) {
      std::fprintf(stderr, "NOTES lost after %lld ms: %s\n",
                   static_cast<long long>(duration_cast<milliseconds>(steady_clock::now() - start).count()), e.what());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ERROR %s\n", e.what());
    return exitCodeFor(e);
  }
}

TEST_F(StudentGroupTest, NotesBetweenBackgroundThreads) {
  const int port = dt::freePort();
  std::vector<std::string> logs{log(0), log(1)};
  std::vector<dt::Child> kids;
  for (int r = 0; r < 2; ++r) kids.push_back(dt::spawnRole("notes", {}, envFor(r, 3, port), logs[r]));
  for (int r = 0; r < 2; ++r) {
    auto st = kids[r].join(seconds(60));
    std::string out = dt::readFile(logs[r]);
    EXPECT_TRUE(st.exited && st.code == 0) << "rank " << r << ": " << st.describe() << "\n" << out;
    EXPECT_NE(out.find("NOTES got v0,v1"), std::string::npos) << out;
    auto pos = out.find("NOTES late r0,- after ");
    ASSERT_NE(pos, std::string::npos) << out;
    long ms = std::stol(out.substr(pos + 22));
    EXPECT_GE(ms, 450) << out;
    EXPECT_LT(ms, 3000) << out;
  }
  std::string out = dt::readFile(logs[1]);
  auto pos = out.find("NOTES lost after ");
  ASSERT_NE(pos, std::string::npos) << out;
  EXPECT_LT(std::stol(out.substr(pos + 17)), 10000) << out;
  EXPECT_NE(out.find("lost the rendezvous store"), std::string::npos) << out;
}
