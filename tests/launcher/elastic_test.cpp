// The elastic teacher when its forward raises (teacher.max_restarts): the
// requests of the failed batch stay in the rings and the restarted teacher
// serves them (a transient failure: the job finishes with every answer
// checked); a failure that repeats on the same request after a restart (a
// deterministic one: a bug in the model, a bad input, distill's own float16
// overflow check) ends the job at once, headlined with the teacher's exception,
// the request's tag and its student, with restarts left unused.
//
// distill-run with 2 students and 1 teacher, this binary in the `elastic`
// role (teacher.kind self). SIGKILLed teachers: launcher_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <regex>
#include <stdexcept>
#include <string>

#include "distill/distill.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

constexpr int kSteps = 10, kAcc = 2; // per student: 20 requests

distill::Session initSession() {
  int argc = 1;
  char arg0[] = "elastic_test";
  char* argv[] = {arg0, nullptr};
  return distill::init(argc, argv);
}

// Doubles its input. mode "raise": raises in its 5th forward, first
// incarnation only; "raise-always": in its 3rd forward and every one after,
// and in every forward of a restarted incarnation; "overflow": never (the students send a value whose double
// is beyond float16, and teacher.payload_dtype is float16).
int serveDoubler(distill::Session& s, const std::string& mode) {
  const char* restart = std::getenv("DISTILL_TEACHER_RESTART");
  std::printf("teacher incarnation %s\n", restart ? restart : "0");
  int calls = 0;
  auto doubler = distill::teacherFromFunction([&](const std::vector<at::Tensor>& in) {
    ++calls;
    if ((mode == "raise" && calls == 5 && !restart) || (mode == "raise-always" && (calls >= 3 || restart)))
      throw std::runtime_error("planted failure in forward " + std::to_string(calls));
    return in.at(0).to(torch::kFloat) * 2;
  });
  auto stats = distill::serve(*s.teacher, doubler);
  std::printf("teacher served %lld requests\n", static_cast<long long>(stats.requests));
  return 0;
}

// One step: `kAcc` requests at once, each unique, every answer checked. With
// `huge` the first request's values double beyond float16's range.
int step(distill::Client& client, int rank, int64_t step, bool huge) {
  std::vector<std::pair<distill::Handle, at::Tensor>> sent;
  for (int64_t a = 0; a < kAcc; ++a) {
    auto x = torch::arange(4, torch::kLong) + 100 * rank + 10 * step + a + (huge && a == 0 ? 100000 : 0);
    sent.emplace_back(client.submit(x, step, a), x);
  }
  for (auto& [h, x] : sent) {
    auto y = client.get(h).tensor(distill::protocol::kLogits).to(torch::kFloat);
    DISTILL_CHECK(torch::equal(y, x.to(torch::kFloat) * 2), "wrong answer at step ", step);
  }
  return kAcc;
}

} // namespace

// args: [mode] (see serveDoubler).
DISTILL_TEST_ROLE(elastic) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = args.at(0);
  distill::Session s = initSession();
  if (s.isTeacher()) return serveDoubler(s, mode);
  const int rank = s.topology.studentRank;
  int answers = 0;
  for (int64_t k = 0; k < kSteps; ++k) {
    answers += step(*s.client, rank, k, mode == "overflow" && k == 3 && rank == 1);
    s.student->group().barrier("step");
  }
  std::printf("ANSWERS rank=%d n=%d of %d\n", rank, answers, kSteps * kAcc);
  s.client->finish();
  return 0;
}

namespace {

class ElasticTest : public LauncherFixture {
 protected:
  std::vector<std::string> args(const std::string& mode, const std::vector<std::string>& more = {}) {
    std::vector<std::string> all = {"--set", "teacher.max_restarts=3", "--set", "student.grad_acc_steps=2",
                                    "--status-every-s", "3600"};
    all.insert(all.end(), more.begin(), more.end());
    return jobArgs(all, {mode}, "elastic");
  }

  // The summary's headline ("job failed: ..."), "" if none.
  static std::string headline(const std::string& text) {
    std::smatch m;
    return std::regex_search(text, m, std::regex("job failed: ([^\n]*)")) ? m[1].str() : "";
  }

  // A repeated failure: the job ends within seconds, its headline names the
  // teacher, the request and its student, and the exception; one restart used of 3.
  void expectGaveUp(Launch& l, const std::string& exception) {
    const auto t0 = SteadyClock::now();
    auto st = l.finish(Ms(60000));
    const std::string& t = l.text();
    EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << t;
    EXPECT_LT(msSince(t0), 20000) << t;
    const std::string h = headline(t);
    EXPECT_TRUE(has(h, "[r2 teacher]")) << h << "\n" << t;
    EXPECT_TRUE(has(h, "failed again on the request an earlier incarnation failed on")) << h;
    EXPECT_TRUE(std::regex_search(h, std::regex(R"(the request \(step \d+, acc_step \d, seq \d+\) of student rank \d)")))
        << h;
    EXPECT_TRUE(has(h, exception)) << h;
    EXPECT_TRUE(has(t, "restarting it (1 of 3 restarts)")) << t;
    EXPECT_FALSE(has(t, "restarting it (2 of 3 restarts)")) << t;
    EXPECT_FALSE(has(t, "hang")) << t;
    expectSegmentGone(l);
  }
};

// A forward that raises once: the restarted teacher serves the failed batch's
// requests, and every request of every student is answered exactly once.
TEST_F(ElasticTest, TeacherThatRaisesOnceIsRestartedAndServesTheFailedBatch) {
  Launch l(args("raise"));
  auto st = l.finish(Ms(90000));
  const std::string& t = l.text();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << t;
  EXPECT_TRUE(has(t, "[r2 teacher] died (exit code 99); restarting it (1 of 3 restarts)")) << t; // 99: a role that threw
  EXPECT_TRUE(has(log(2), "planted failure in forward 5")) << log(2);
  EXPECT_TRUE(has(t, "job finished: every rank exited 0, teacher restarted 1 of 3 times")) << t;
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(has(log(r), "ANSWERS rank=" + std::to_string(r) + " n=20 of 20")) << "rank " << r << ": " << log(r);
  expectSegmentGone(l);
}

// A forward that raises every time from its 3rd call: one restart, the same
// request fails again, and the job ends naming it, not at the hang timeout.
TEST_F(ElasticTest, TeacherThatRaisesAgainOnTheSameRequestEndsTheJobNamingIt) {
  Launch l(args("raise-always"));
  expectGaveUp(l, "planted failure in forward 1");
}

// distill's own check (a float16 payload that overflows) repeats the same way.
TEST_F(ElasticTest, Float16OverflowRepeatsAndEndsTheJobNamingTheRequest) {
  Launch l(args("overflow", {"--set", "teacher.payload_dtype=float16"}));
  expectGaveUp(l, "(teacher.payload_dtype)");
}

} // namespace
