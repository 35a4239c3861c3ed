#pragma once

// Helpers of the ipc tests: unique segments that are removed (and checked to
// be gone from /dev/shm) at the end of every test, and waits on the process
// table of a segment (observing a peer's state instead of sleeping).

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include "distill/core/clock.h"
#include "distill/ipc/channel.h"
#include "distill/ipc/segment.h"
#include "support/process.h"

namespace distill::ipc::test {

inline bool shmExists(const std::string& name) {
  struct stat st;
  return ::stat(("/dev/shm/" + name).c_str(), &st) == 0;
}

// A unique segment name; the destructor removes the segment and asserts it is gone.
struct ScopedName {
  std::string name = distill::testing::uniqueName("distill-ipc");
  ~ScopedName() {
    Segment::remove(name);
    EXPECT_FALSE(shmExists(name)) << "/dev/shm/" << name << " left behind";
  }
};

inline SegmentLayout smallLayout(int students = 1, int slots = 4, int heartbeatMs = 100) {
  SegmentLayout l;
  l.numStudents = students;
  l.slots = slots;
  l.maxRequestBytes = 1 << 20;
  l.maxResponseBytes = 1 << 20;
  l.heartbeatMs = heartbeatMs;
  return l;
}

// Polls the process table (cheap reads of shared memory) until pred holds.
inline bool waitForProcess(const Segment& seg, int localIndex, const std::function<bool(const ProcessSnapshot&)>& pred,
                           std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = Deadline::after(timeout);
  while (!deadline.expired()) {
    if (pred(seg.processes().at(size_t(localIndex)))) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline EndpointOptions opts(int rank) {
  EndpointOptions o;
  o.rank = rank;
  return o;
}

// A request (or `kind`) tagged from `seq`: step seq / 3, acc_step seq % 3, one
// int64 tensor "x" holding seq twice.
inline OutMessage msgWith(uint64_t seq, MsgKind kind = MsgKind::kRequest) {
  OutMessage m;
  m.tag = Tag{seq, int64_t(seq / 3), int64_t(seq % 3)};
  m.kind = kind;
  m.tensors.push_back({"x", at::full({2}, int64_t(seq), at::kLong)});
  return m;
}

// A teacher child: attach, admit, echo every request as a response until a finish.
inline int echoTeacher(const std::string& name, const std::string& job, int rank) {
  using namespace std::chrono_literals;
  auto seg = Segment::attach(name, job, std::nullopt, Deadline::after(10s));
  TeacherEndpoint t(seg, opts(rank));
  t.waitAdmission(Deadline::after(10s));
  for (;;) {
    auto m = t.waitAny(Deadline::after(30s));
    if (m.kind() == MsgKind::kFinish) return 0;
    OutMessage r;
    r.tag = m.tag();
    r.kind = MsgKind::kResponse;
    r.tensors.push_back({"x", m.view("x")});
    t.reply(m.student(), r, Deadline::after(30s));
  }
}

} // namespace distill::ipc::test
