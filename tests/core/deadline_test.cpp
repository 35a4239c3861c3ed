// Issue 14 item 11: a duration becomes a deadline without overflowing.
// run.hang_timeout_s=1e300 or 5e9, startup 1e10, collective 1e10 used to
// wrap the steady clock into the past, so every wait on them timed out at once
// ("after 0 ms"). The config now keeps every duration in a range (config_test);
// clock.h saturates whatever still comes in: a deadline past the clock's range
// never expires. The last test waits for real, across processes, on such
// deadlines and ends the waits by the segment's abort flag instead.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "ipc/ipc_test_util.h"

using namespace distill;
using distill::ipc::test::ScopedName;
using distill::ipc::test::smallLayout;
using distill::ipc::test::waitForProcess;
using distill::testing::forkChild;
using namespace std::chrono_literals;

namespace {

TEST(Deadline, DurationsSaturateInsteadOfWrapping) {
  EXPECT_EQ(saturatingDuration(Millis::max()), Clock::duration::max());
  EXPECT_EQ(saturatingDuration(std::chrono::hours::max()), Clock::duration::max());
  EXPECT_EQ(saturatingDuration(std::chrono::hours::min()), Clock::duration::min());
  EXPECT_EQ(saturatingDuration(std::chrono::seconds(10'000'000'000)), Clock::duration::max()); // 1e10 s
  EXPECT_EQ(saturatingDuration(std::chrono::seconds(5'000'000'000)), std::chrono::seconds(5'000'000'000));
  EXPECT_EQ(saturatingDuration(Millis(1500)), std::chrono::nanoseconds(1'500'000'000));
  EXPECT_EQ(saturatingDuration(std::chrono::nanoseconds(7)), std::chrono::nanoseconds(7));

  EXPECT_EQ(secondsToDuration(1e300), Clock::duration::max());
  EXPECT_EQ(secondsToDuration(1e10), Clock::duration::max());
  EXPECT_EQ(secondsToDuration(std::numeric_limits<double>::infinity()), Clock::duration::max());
  EXPECT_EQ(secondsToDuration(-1e300), Clock::duration::min());
  EXPECT_EQ(secondsToDuration(std::nan("")), Clock::duration::zero());
  EXPECT_EQ(secondsToDuration(2.5), std::chrono::nanoseconds(2'500'000'000));
  EXPECT_EQ(secondsToDuration(2592000), std::chrono::hours(720)); // 30 days, the longest config timeout

  EXPECT_EQ(secondsToMillis(1e300), Millis::max());
  EXPECT_EQ(secondsToMillis(5e9), Millis(5'000'000'000'000));
  EXPECT_EQ(secondsToMillis(0.0015), Millis(1));
  EXPECT_EQ(secondsToMillis(std::nan("")), Millis::zero());
}

TEST(Deadline, AHugeTimeoutNeverExpires) {
  for (const Deadline d : {Deadline::after(Clock::duration::max()), Deadline::after(Millis::max()),
                           Deadline::after(std::chrono::seconds(10'000'000'000)), Deadline::afterSeconds(1e300),
                           Deadline::afterSeconds(5e9 * 2)}) {
    EXPECT_FALSE(d.expired());
    EXPECT_TRUE(d.isNever());
    EXPECT_GT(d.remaining(), std::chrono::hours(24 * 365));
  }
  // 5e9 s fits the clock (~292 years): a real, far deadline.
  const Deadline far = Deadline::afterSeconds(5e9);
  EXPECT_FALSE(far.expired());
  EXPECT_FALSE(far.isNever());
  EXPECT_GT(far.remaining(), std::chrono::seconds(4'999'999'000));
  // Short ones are unchanged.
  const auto before = Clock::now();
  const Deadline soon = Deadline::after(Millis(250));
  EXPECT_GE(soon.when() - before, Millis(250));
  EXPECT_LT(soon.when() - before, Millis(250) + 10s);
  EXPECT_TRUE(Deadline::after(Millis(-5)).expired());
  EXPECT_TRUE(Deadline::afterSeconds(0).expired());
}

// A student waiting for a response and its teacher waiting for a request, each
// with a deadline past the clock's range, in two processes: both really wait
// (the process table shows them waiting) until the segment is aborted. Before
// the fix both deadlines wrapped into the past and each wait was a
// TimeoutError at once.
TEST(Deadline, WaitsOnHugeDeadlinesWaitUntilTheMechanismEndsThem) {
  ScopedName sn;
  const std::string job = "job-deadline-test";
  auto seg = ipc::Segment::create(sn.name, smallLayout(1), job);
  // 0: ended by the abort (IpcError naming it); 3: a timeout; 4: anything else.
  auto ended = [](const std::function<void()>& wait) {
    try {
      wait();
    } catch (const IpcError& e) {
      return std::string(e.what()).find("was aborted") != std::string::npos ? 0 : 4;
    } catch (const TimeoutError& e) {
      std::fprintf(stderr, "timed out: %s\n", e.what());
      return 3;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 4;
    }
    return 4;
  };
  auto teacher = forkChild([&] {
    auto s = ipc::Segment::attach(sn.name, job, std::nullopt, Deadline::after(10s));
    ipc::TeacherEndpoint t(s, distill::ipc::test::opts(1));
    t.waitAdmission(Deadline::after(10s));
    return ended([&] { t.waitAny(Deadline::after(Millis::max())); });
  });
  auto student = forkChild([&] {
    auto s = ipc::Segment::attach(sn.name, job, std::nullopt, Deadline::after(10s));
    ipc::StudentEndpoint st(s, 0, distill::ipc::test::opts(0));
    st.waitAdmission(Deadline::after(10s));
    return ended([&] { st.receive(Deadline::after(std::chrono::seconds(10'000'000'000))); }); // 1e10 s
  });
  auto waitingFor = [](const char* what) {
    return [what](const ipc::ProcessSnapshot& p) { return p.state == "waiting" && p.waitWhat == what; };
  };
  const bool studentWaits = waitForProcess(seg, 0, waitingFor("response"));
  const bool teacherWaits = waitForProcess(seg, 1, waitingFor("request"));
  seg.abort();
  const auto s = student.join(10s);
  const auto t = teacher.join(10s);
  EXPECT_TRUE(studentWaits) << "the student never waited for its response";
  EXPECT_TRUE(teacherWaits) << "the teacher never waited for a request";
  EXPECT_TRUE(s.exited && s.code == 0) << s.describe();
  EXPECT_TRUE(t.exited && t.code == 0) << t.describe();
}

} // namespace
