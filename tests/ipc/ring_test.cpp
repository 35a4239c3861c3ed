// Rings, waits and liveness with real processes (forkChild: nothing
// here touches CUDA). Every test removes its segment and checks /dev/shm.
// The segment's own tests (part of ipc_ring_test): segment_test.cpp.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include <map>

#include "distill/core/errors.h"
#include "distill/core/topology.h"
#include "distill/ipc/channel.h"
#include "ipc_test_util.h"
#include "wire.h"

using namespace distill;
using namespace distill::ipc;
using namespace distill::ipc::test;
using distill::testing::forkChild;
using namespace std::chrono_literals;

namespace {

const std::string kJob = "job-ring-test";

} // namespace

TEST(IpcRing, OrderAndWrapAround100kMessages) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(1, 4), kJob);
  auto teacher = forkChild([&] { return echoTeacher(sn.name, kJob, 1); });
  {
    StudentEndpoint s(seg, 0, opts(0));
    s.waitAdmission(Deadline::after(10s));
    constexpr uint64_t kN = 100000, kWindow = 3;
    uint64_t next = 0;
    for (uint64_t i = 0; i < kN; ++i) {
      s.send(msgWith(i), Deadline::after(10s));
      if (i + 1 >= kWindow) {
        auto r = s.receive(Deadline::after(10s));
        ASSERT_EQ(r.tag().seq, next);
        ASSERT_EQ(r.tag().step, int64_t(next / 3));
        ASSERT_EQ(r.view("x")[1].item<int64_t>(), int64_t(next));
        ++next;
      }
    }
    while (next < kN) {
      auto r = s.receive(Deadline::after(10s));
      ASSERT_EQ(r.tag().seq, next++);
    }
    OutMessage fin;
    fin.kind = MsgKind::kFinish;
    s.send(fin, Deadline::after(10s));
  }
  EXPECT_EQ(teacher.join(30s).code, 0);
}

TEST(IpcRing, BackpressureBlocksProducerUntilASlotIsFreed) {
  ScopedName sn;
  constexpr int K = 4;
  auto seg = Segment::create(sn.name, smallLayout(1, K), kJob);
  auto student = forkChild([&] {
    auto s2 = Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(10s));
    StudentEndpoint s(s2, 0, opts(0));
    s.waitAdmission(Deadline::after(10s));
    for (int i = 0; i <= K; ++i) s.send(msgWith(uint64_t(i)), Deadline::after(20s)); // the last one blocks
    return 0;
  });
  TeacherEndpoint t(seg, opts(1));
  t.waitAdmission(Deadline::after(10s));
  std::vector<ReceivedMessage> held;
  for (int i = 0; i < K; ++i) held.push_back(t.waitAny(Deadline::after(10s)));
  // The student now waits for a free request slot: observe it in the process table.
  ASSERT_TRUE(waitForProcess(
      seg, 0, [](const ProcessSnapshot& p) { return p.state == "waiting" && p.waitWhat == "free request slot"; }));
  EXPECT_FALSE(t.poll(0).has_value());
  EXPECT_FALSE(student.waitFor(50ms).has_value()) << "producer did not block";
  held[0].release();
  auto last = t.waitAny(Deadline::after(10s));
  EXPECT_EQ(last.tag().seq, uint64_t(K));
  EXPECT_EQ(student.join(10s).code, 0);
}

TEST(IpcRing, DeadlineExpiryNamesWhatWasAwaited) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(1), kJob);
  // No teacher at all: admission times out and says the teacher never attached.
  StudentEndpoint s(seg, 0, opts(5));
  auto t0 = Clock::now();
  try {
    s.waitAdmission(Deadline::after(150ms));
    FAIL() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_GE(Clock::now() - t0, 150ms);
    EXPECT_TRUE(contains(e.what(), "never attached")) << e.what();
    EXPECT_TRUE(contains(e.what(), "student rank 5")) << e.what();
    EXPECT_TRUE(contains(e.what(), "within 1")) << e.what();
  }
  // A teacher that admits but never answers: the receive names the tag and the teacher.
  auto teacher = forkChild([&] {
    auto s2 = Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(10s));
    TeacherEndpoint t(s2, opts(7));
    t.waitAdmission(Deadline::after(10s));
    auto m = t.waitAny(Deadline::after(20s)); // the finish below
    return m.kind() == MsgKind::kFinish ? 0 : 1;
  });
  s.waitAdmission(Deadline::after(10s));
  t0 = Clock::now();
  try {
    s.receive(Deadline::after(200ms), Tag{11, 4, 1});
    FAIL() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_GE(Clock::now() - t0, 200ms);
    const std::string w = e.what();
    EXPECT_TRUE(contains(w, "no response from teacher rank 7")) << w;
    EXPECT_TRUE(contains(w, "after 2")) << w;
    EXPECT_TRUE(contains(w, "step=4 acc_step=1")) << w;
    EXPECT_TRUE(contains(w, "awaiting seq 11")) << w;
  }
  OutMessage fin;
  fin.kind = MsgKind::kFinish;
  s.send(fin, Deadline::after(5s));
  EXPECT_EQ(teacher.join(10s).code, 0);
}

TEST(IpcRing, AttachTimesOutWhenNoSegment) {
  ScopedName sn;
  try {
    Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(100ms));
    FAIL() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), sn.name + "' did not appear")) << e.what();
  }
}

namespace {

// Parent waits in `wait`; a helper thread applies `sig` to `victim` once the
// parent's process-table entry shows it sleeping, and returns the time it did.
template <typename Wait>
std::pair<std::string, Clock::duration> lossDetected(const Segment& seg, int selfIndex, distill::testing::Child& victim,
                                                     int sig, Wait wait) {
  std::atomic<int64_t> sentNs{0};
  std::thread killer([&] {
    if (waitForProcess(seg, selfIndex, [](const ProcessSnapshot& p) { return p.state == "waiting"; })) {
      sentNs = monotonicNs();
      victim.kill(sig);
    }
  });
  std::string what;
  try {
    wait();
    ADD_FAILURE() << "no PeerLostError";
  } catch (const PeerLostError& e) {
    what = e.what();
  }
  const int64_t now = monotonicNs();
  killer.join();
  return {what, std::chrono::nanoseconds(now - sentNs.load())};
}

} // namespace

TEST(IpcRing, TeacherKilledWhileStudentWaits) {
  ScopedName sn;
  const int hb = 100;
  auto seg = Segment::create(sn.name, smallLayout(1, 4, hb), kJob);
  auto teacher = forkChild([&] { return echoTeacher(sn.name, kJob, 9); });
  StudentEndpoint s(seg, 0, opts(0));
  s.waitAdmission(Deadline::after(10s));
  auto [what, elapsed] = lossDetected(seg, 0, teacher, SIGKILL, [&] { s.receive(Deadline::after(20s), Tag{1, 2, 0}); });
  EXPECT_LT(elapsed, std::chrono::milliseconds(2 * hb + 150)) << what;
  EXPECT_TRUE(contains(what, "teacher rank 9")) << what;
  EXPECT_TRUE(contains(what, "died")) << what;
  EXPECT_TRUE(contains(what, "step=2")) << what;
  // The endpoint is poisoned: the next call rethrows at once.
  EXPECT_THROW(s.receive(Deadline::after(5s)), PeerLostError);
  EXPECT_EQ(teacher.join(10s).signal, SIGKILL);
}

TEST(IpcRing, StudentKilledWhileTeacherWaits) {
  ScopedName sn;
  const int hb = 100;
  auto seg = Segment::create(sn.name, smallLayout(2, 4, hb), kJob);
  auto student0 = forkChild([&] {
    auto s2 = Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(10s));
    StudentEndpoint s(s2, 0, opts(0));
    s.waitAdmission(Deadline::after(10s));
    s.receive(Deadline::after(30s)); // never answered
    return 0;
  });
  auto student1 = forkChild([&] {
    auto s2 = Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(10s));
    StudentEndpoint s(s2, 1, opts(4));
    s.waitAdmission(Deadline::after(10s));
    s.receive(Deadline::after(30s));
    return 0;
  });
  TeacherEndpoint t(seg, opts(2));
  t.waitAdmission(Deadline::after(10s));
  auto [what, elapsed] = lossDetected(seg, 2, student1, SIGKILL, [&] { t.waitAny(Deadline::after(20s)); });
  EXPECT_LT(elapsed, std::chrono::milliseconds(2 * hb + 150)) << what;
  EXPECT_TRUE(contains(what, "student rank 4")) << what;
  student0.kill(SIGKILL);
  student0.join(10s);
  student1.join(10s);
}

// tryWaitAny: a quiet period is no error (nullopt at the deadline, no
// exception), a request is returned, a dead student is still a PeerLostError.
TEST(IpcRing, TryWaitAnyEndsEmptyAtTheDeadlineAndThrowsOnlyForFailures) {
  ScopedName sn;
  const int hb = 100;
  auto seg = Segment::create(sn.name, smallLayout(1, 4, hb), kJob);
  auto student = forkChild([&] {
    auto s2 = Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(10s));
    StudentEndpoint s(s2, 0, opts(3));
    s.waitAdmission(Deadline::after(10s));
    s.receive(Deadline::after(30s)); // the teacher's go
    s.send(msgWith(7), Deadline::after(10s));
    s.receive(Deadline::after(30s)); // never answered
    return 0;
  });
  TeacherEndpoint t(seg, opts(1));
  t.waitAdmission(Deadline::after(10s));
  const auto t0 = Clock::now();
  EXPECT_FALSE(t.tryWaitAny(Deadline::after(150ms)).has_value());
  EXPECT_GE(Clock::now() - t0, 150ms);
  t.reply(0, msgWith(0, MsgKind::kResponse), Deadline::after(10s));
  auto m = t.tryWaitAny(Deadline::after(10s));
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->tag().seq, 7u);
  m->release();
  auto [what, elapsed] = lossDetected(seg, 1, student, SIGKILL, [&] { t.tryWaitAny(Deadline::after(20s)); });
  EXPECT_TRUE(contains(what, "student rank 3")) << what;
  student.join(10s);
}

// A stopped peer is alive: a stall, lost only after transport.stall_timeout_s
// (here 500 ms), and the error says it stalled and is stopped.
TEST(IpcRing, StoppedPeerIsLostAfterTheStallTimeout) {
  ScopedName sn;
  const int hb = 100;
  auto layout = smallLayout(1, 4, hb);
  layout.stallTimeoutMs = 500;
  auto seg = Segment::create(sn.name, layout, kJob);
  auto teacher = forkChild([&] { return echoTeacher(sn.name, kJob, 9); });
  StudentEndpoint s(seg, 0, opts(0));
  s.waitAdmission(Deadline::after(10s));
  auto [what, elapsed] = lossDetected(seg, 0, teacher, SIGSTOP, [&] { s.receive(Deadline::after(20s)); });
  EXPECT_GE(elapsed, 500ms - std::chrono::milliseconds(hb)) << what; // its last heartbeat may predate the stop
  EXPECT_LT(elapsed, 500ms + std::chrono::milliseconds(2 * hb + 150)) << what;
  EXPECT_TRUE(contains(what, "teacher rank 9")) << what;
  EXPECT_TRUE(contains(what, "stalled (no heartbeat for")) << what;
  EXPECT_TRUE(contains(what, "transport.stall_timeout_s=0.5 s")) << what;
  EXPECT_TRUE(contains(what, "process is stopped")) << what;
  teacher.kill(SIGCONT);
  teacher.kill(SIGKILL);
  EXPECT_EQ(teacher.join(10s).signal, SIGKILL);
}

// A peer stopped for ten heartbeats and continued is no loss: the wait goes on
// and gets its answer (the default stall timeout is 60 s).
TEST(IpcRing, StoppedAndContinuedPeerIsNoLoss) {
  ScopedName sn;
  const int hb = 100;
  auto seg = Segment::create(sn.name, smallLayout(1, 4, hb), kJob);
  auto teacher = forkChild([&] { return echoTeacher(sn.name, kJob, 9); });
  StudentEndpoint s(seg, 0, opts(0));
  s.waitAdmission(Deadline::after(10s));
  ASSERT_TRUE(waitForProcess(seg, 1, [](const ProcessSnapshot& p) { return p.state == "waiting"; }));
  teacher.kill(SIGSTOP);
  s.send(msgWith(1), Deadline::after(10s));
  std::thread resume([&] {
    // Continue it once its heartbeat is ten periods old: the stall is real.
    waitForProcess(
        seg, 1, [&](const ProcessSnapshot& p) { return p.heartbeatAgeMs > 10 * hb; }, 10s);
    teacher.kill(SIGCONT);
  });
  auto r = s.receive(Deadline::after(20s));
  resume.join();
  EXPECT_EQ(r.tag().seq, 1u);
  r.release();
  OutMessage fin;
  fin.kind = MsgKind::kFinish;
  s.send(fin, Deadline::after(10s));
  EXPECT_EQ(teacher.join(10s).code, 0);
}

// A pool of two teachers over three students: student i's ring is read by
// teacher i % 2 and by no other, and the launcher's layout (Topology) places
// that teacher at the local rank the ring says.
TEST(IpcRing, PoolOfTwoTeachersEachReadsOnlyItsStudentsRings) {
  ScopedName sn;
  SegmentLayout l = smallLayout(3);
  l.numTeachers = 2;
  auto seg = Segment::create(sn.name, l, kJob);
  EXPECT_EQ(seg.numTeachers(), 2);
  std::vector<StudentEndpoint> students;
  for (int i = 0; i < 3; ++i) students.emplace_back(seg, i, opts(i));
  TeacherEndpoint t0(seg, opts(3), 0), t1(seg, opts(4), 1);
  EXPECT_EQ(t0.students(), (std::vector<int>{0, 2}));
  EXPECT_EQ(t1.students(), (std::vector<int>{1}));
  for (int i = 0; i < 3; ++i) {
    const auto topo = Topology::forLocalRank(0, 1, i, 5, 2);
    EXPECT_EQ(topo.teacherLocalRankOf(i), 3 + i % 2) << "student " << i;
  }
  EXPECT_TRUE(Topology::forLocalRank(0, 1, 4, 5, 2).isTeacher());
  EXPECT_EQ(Topology::forLocalRank(0, 1, 4, 5, 2).teacherIndex, 1);
  t0.waitAdmission(Deadline::after(10s));
  t1.waitAdmission(Deadline::after(10s));
  EXPECT_TRUE(seg.admitted());
  for (auto& s : students) s.waitAdmission(Deadline::after(10s));
  for (int i = 0; i < 3; ++i) students[size_t(i)].send(msgWith(uint64_t(10 + i)), Deadline::after(10s));
  // Teacher 0 gets students 0 and 2, each its own request; teacher 1 student 1's.
  std::map<int, uint64_t> got0;
  for (int n = 0; n < 2; ++n) {
    auto m = t0.waitAny(Deadline::after(10s));
    got0[m.student()] = m.tag().seq;
  }
  EXPECT_EQ(got0, (std::map<int, uint64_t>{{0, 10}, {2, 12}}));
  auto m1 = t1.waitAny(Deadline::after(10s));
  EXPECT_EQ(m1.student(), 1);
  EXPECT_EQ(m1.tag().seq, 11u);
  EXPECT_FALSE(t1.tryWaitAny(Deadline::after(20ms)).has_value());
  EXPECT_FALSE(t0.tryWaitAny(Deadline::after(20ms)).has_value());
  // A teacher index the segment does not have is refused, naming the range.
  try {
    TeacherEndpoint t2(seg, opts(5), 2);
    FAIL() << "teacher 2 of 2 attached";
  } catch (const IpcError& e) {
    EXPECT_TRUE(contains(e.what(), "no teacher 2")) << e.what();
  }
}
