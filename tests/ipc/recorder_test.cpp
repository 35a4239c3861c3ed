// The flight recorder: what one process records is read back, consistently,
// by another (real processes, a real segment), and the activity derived from
// it names waits, collectives and user code.
#include <unistd.h>

#include <ATen/ATen.h>

#include <atomic>

#include "distill/core/trace.h"
#include "distill/ipc/channel.h"
#include "distill/ipc/hang_report.h"
#include "ipc_test_util.h"
#include "recorder.h"
#include "segment_impl.h"

using namespace distill;
using namespace distill::ipc;
using namespace distill::ipc::test;
using distill::testing::forkChild;
using namespace std::chrono_literals;

namespace {

const std::string kJob = "job-recorder-test";

// An event as the student group (collectives) or ckpt (saves) records it.
trace::Event event(trace::Op op, uint64_t seq, int64_t step, const std::string& label) {
  trace::Event e;
  e.op = op;
  e.seq = seq;
  e.step = step;
  e.accStep = step >= 0 ? 0 : -1;
  e.label = label;
  return e;
}

bool anyContains(const std::vector<std::string>& lines, const std::string& part) {
  for (auto& l : lines)
    if (contains(l, part)) return true;
  return false;
}

} // namespace

TEST(IpcRecorder, RingTrafficCollectivesAndUserCodeAsSeenByAnotherProcess) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(1, 4), kJob);
  auto teacher = forkChild([&] { return echoTeacher(sn.name, kJob, 1); });
  StudentEndpoint s(seg, 0, opts(0));
  s.waitAdmission(Deadline::after(10s));
  const uint64_t before = progressCount(seg);
  for (uint64_t i = 1; i <= 3; ++i) {
    s.send(msgWith(i), Deadline::after(10s));
    s.receive(Deadline::after(10s));
  }
  EXPECT_GT(progressCount(seg), before);

  // The teacher, in its own process, now waits for the next request.
  ASSERT_TRUE(waitForProcess(seg, 1, [](const ProcessSnapshot& p) { return p.waitWhat == "request"; }));
  auto acts = describeActivity(seg, 5);
  ASSERT_EQ(acts.size(), 2u);
  EXPECT_TRUE(contains(acts[1].doing, "waiting for request from any student for")) << acts[1].doing;
  EXPECT_TRUE(anyContains(acts[1].lastEvents, "reply to student rank 0 (step 1, acc_step 0, seq 3)"))
      << formatHangTable(seg, "t");
  EXPECT_TRUE(anyContains(acts[1].lastEvents, "request from student rank 0 (step 1, acc_step 0, seq 3)"))
      << formatHangTable(seg, "t");
  // This process: after its last receive it is in user code.
  EXPECT_TRUE(contains(acts[0].doing, "busy in user code for") &&
              contains(acts[0].doing, "since its last distill call ended: receive at step 1 acc_step 0"))
      << acts[0].doing;
  EXPECT_TRUE(anyContains(acts[0].lastEvents, "send to teacher rank 1 (step 0, acc_step 2, seq 2)"))
      << formatHangTable(seg, "t");

  // A collective recorded through the process's trace sink (as the student group does).
  {
    trace::Scope open(event(trace::Op::kCollective, 7, 4, "grads"));
    auto now = describeActivity(seg, 5);
    EXPECT_TRUE(contains(now[0].doing, "in student group grads #7 at step 4 acc_step 0 for")) << now[0].doing;
    EXPECT_TRUE(anyContains(now[0].lastEvents, "collective 'grads' #7 (step 4, acc_step 0), still open"))
        << formatHangTable(seg, "t");
  }
  // A checkpoint save (ckpt records it so): shown while open, and the
  // collective inside it is what the table names (the innermost open event).
  {
    trace::Scope saving(event(trace::Op::kCheckpoint, 0, 9, "save"));
    EXPECT_TRUE(contains(describeActivity(seg)[0].doing, "in checkpoint save at step 9 for"))
        << describeActivity(seg)[0].doing;
    trace::Scope inside(event(trace::Op::kCollective, 8, -1, "checkpoint barrier"));
    EXPECT_TRUE(contains(describeActivity(seg)[0].doing, "in student group checkpoint barrier #8"))
        << describeActivity(seg)[0].doing;
  }
  // The collective of step 4 stays the newest one in the history.
  { trace::Scope again(event(trace::Op::kCollective, 7, 4, "grads")); }
  auto after = describeActivity(seg, 5);
  EXPECT_TRUE(contains(after[0].doing, "since its last distill call ended: collective #7 at step 4")) << after[0].doing;

  const std::string table = formatHangTable(seg, "hang table", {{0, "note for local 0"}});
  EXPECT_TRUE(contains(table, "hang table\n")) << table;
  EXPECT_TRUE(contains(table, "[note for local 0]")) << table;
  EXPECT_TRUE(contains(table, "last 5 events of r1 teacher:")) << table;

  OutMessage fin;
  fin.kind = MsgKind::kFinish;
  s.send(fin, Deadline::after(10s));
  EXPECT_EQ(teacher.join(30s).code, 0);
  ASSERT_TRUE(waitForProcess(seg, 1, [](const ProcessSnapshot& p) { return p.state == "finished"; }));
  EXPECT_TRUE(contains(describeActivity(seg)[1].doing, "finished (detached cleanly)"));
}

// A writer process records 200 000 events as fast as it can (the ring wraps
// ~1600 times) while this process reads the newest ones: every event read
// back is whole (its fields belong together), numbers are consecutive, and
// the reader never sees a half-written event.
TEST(IpcRecorder, ConcurrentReadsSeeWholeEventsOnly) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(1, 4), kJob);
  const auto& area = seg.impl()->recorder(0);
  constexpr uint64_t kEvents = 200000;
  auto writer = forkChild([&] {
    Recorder rec(&seg.impl()->recorder(0));
    rec.reset();
    for (uint64_t i = 1; i <= kEvents; ++i) {
      trace::Event e;
      e.op = trace::Op::kCollective;
      e.seq = i;
      e.step = int64_t(i * 3);
      e.accStep = int64_t(i % 5);
      e.peer = int(i % 7);
      e.label = "event number " + std::to_string(i) + (i % 2 ? " with a longer label past two words" : "");
      rec.end(rec.begin(e));
    }
    return 0;
  });
  uint64_t reads = 0, checked = 0;
  for (;;) {
    const bool finished = area.begun.load(std::memory_order_acquire) == kEvents;
    auto evs = readEvents(area, 5);
    ++reads;
    for (size_t k = 0; k < evs.size(); ++k) {
      const auto& e = evs[k];
      ASSERT_EQ(e.seq, e.number);
      ASSERT_EQ(e.step, int64_t(e.number * 3));
      ASSERT_EQ(e.accStep, int64_t(e.number % 5));
      ASSERT_EQ(e.peer, int(e.number % 7));
      ASSERT_EQ(
          e.label,
          "event number " + std::to_string(e.number) + (e.number % 2 ? " with a longer label past two words" : ""));
      if (k > 0) {
        ASSERT_GT(e.number, evs[k - 1].number);
      }
      ++checked;
    }
    if (finished) {
      ASSERT_EQ(evs.size(), 5u);
      EXPECT_EQ(evs.back().number, kEvents);
      break;
    }
  }
  EXPECT_EQ(writer.join(30s).code, 0);
  EXPECT_EQ(area.progress.load(), 2 * kEvents);
  std::printf("recorder: %llu reads, %llu events checked while 200000 were written\n",
              static_cast<unsigned long long>(reads), static_cast<unsigned long long>(checked));
}
