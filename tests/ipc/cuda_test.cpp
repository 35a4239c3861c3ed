// CUDA IPC buffers between two real processes. The test re-executes its own
// binary (fork+exec, never a plain fork once CUDA is in play) in a role:
// IpcCudaRole.{Student,Teacher} run only when DISTILL_IPC_CUDA_SEGMENT is set.
// Each signal path runs (stream memory operations, the default on one GPU, and
// the interprocess events it falls back to); the flag page's host logic has its
// own CPU test (flag_page_test.cpp).
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "distill/core/errors.h"
#include "distill/ipc/channel.h"
#include "ipc_test_util.h"

using namespace distill;
using namespace distill::ipc;
using namespace distill::ipc::test;
using namespace std::chrono_literals;

namespace {

const std::string kJob = "job-cuda-test";

int visibleDevices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

const char* roleSegment() { return std::getenv("DISTILL_IPC_CUDA_SEGMENT"); }

EndpointOptions cudaOpts(int rank, int device) {
  EndpointOptions o;
  o.rank = rank;
  o.cudaIpc = distill::CudaIpc::kOn;
  o.cudaDevice = device;
  return o;
}

std::string selfExe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

} // namespace

TEST(IpcCudaRole, Teacher) {
  if (!roleSegment()) GTEST_SKIP() << "role process only";
  auto seg = Segment::attach(roleSegment(), kJob, std::nullopt, Deadline::after(20s));
  TeacherEndpoint t(seg, cudaOpts(1, visibleDevices() - 1));
  t.waitAdmission(Deadline::after(20s));
  for (;;) {
    auto m = t.waitAny(Deadline::after(60s));
    if (m.kind() == MsgKind::kFinish) break;
    auto x = m.view("x");
    ASSERT_TRUE(x.is_cuda());
    OutMessage r;
    r.tag = m.tag();
    r.kind = MsgKind::kResponse;
    r.tensors.push_back({"y", x * 2});
    t.reply(m.student(), r, Deadline::after(20s));
  }
}

TEST(IpcCudaRole, Student) {
  if (!roleSegment()) GTEST_SKIP() << "role process only";
  auto seg = Segment::attach(roleSegment(), kJob, std::nullopt, Deadline::after(20s));
  StudentEndpoint s(seg, 0, cudaOpts(0, 0));
  s.waitAdmission(Deadline::after(20s));
  at::manual_seed(3);
  for (uint64_t i = 0; i < 20; ++i) {
    auto x = at::randn({1000 + int64_t(i), 33}, at::TensorOptions().device(at::kCUDA, 0).dtype(at::kBFloat16));
    OutMessage m;
    m.tag = Tag{i, int64_t(i), 0};
    m.tensors.push_back({"x", x});
    s.send(m, Deadline::after(20s));
    auto r = s.receive(Deadline::after(20s));
    ASSERT_EQ(r.tag().seq, i);
    auto y = r.view("y");
    ASSERT_TRUE(y.is_cuda());
    ASSERT_TRUE(at::equal(y.to(x.device()), x * 2)) << "message " << i;
  }
  OutMessage fin;
  fin.kind = MsgKind::kFinish;
  s.send(fin, Deadline::after(20s));
}

namespace {

// Runs the two roles over a fresh segment of 2 slots (so slots are reused: the producer's waits for the
// consumer's reads run) with DISTILL_CUDA_IPC_SIGNAL=`signal`; returns the two logs (stderr of both).
std::string runPair(const std::string& signal) {
  ScopedName sn;
  SegmentLayout l = smallLayout(1, 2);
  l.maxRequestBytes = l.maxResponseBytes = 4 << 20;
  auto seg = Segment::create(sn.name, l, kJob);
  const std::string exe = selfExe();
  std::map<std::string, std::string> env{{"DISTILL_IPC_CUDA_SEGMENT", sn.name}, {"DISTILL_CUDA_IPC_SIGNAL", signal}};
  const std::string tlog = "/tmp/" + sn.name + ".teacher.log", slog = "/tmp/" + sn.name + ".student.log";
  auto teacher = distill::testing::spawn({exe, "--gtest_filter=IpcCudaRole.Teacher"}, env, tlog);
  auto student = distill::testing::spawn({exe, "--gtest_filter=IpcCudaRole.Student"}, env, slog);
  EXPECT_EQ(student.join(120s).code, 0);
  EXPECT_EQ(teacher.join(60s).code, 0);
  const std::string logs = distill::testing::readFile(tlog) + distill::testing::readFile(slog);
  std::remove(tlog.c_str());
  std::remove(slog.c_str());
  return logs;
}

} // namespace

// The default: on one GPU both rings signal by stream memory operations on their flag pages (issue 42);
// with the teacher on another GPU, by interprocess events. Both ends log the path.
TEST(IpcCuda, TensorsTravelThroughCudaIpcBuffers) {
  if (roleSegment()) GTEST_SKIP() << "role process";
  if (visibleDevices() == 0) GTEST_SKIP() << "no CUDA device visible";
  const std::string logs = runPair("auto");
  const char* path = visibleDevices() == 1 ? "signalled by stream memory operations" : "signalled by interprocess CUDA events";
  EXPECT_NE(logs.find(path), std::string::npos) << logs;
}

// The fallback, forced: the interprocess events of the path before issue 42 still carry every message.
TEST(IpcCuda, TheEventPathStillWorks) {
  if (roleSegment()) GTEST_SKIP() << "role process";
  if (visibleDevices() == 0) GTEST_SKIP() << "no CUDA device visible";
  const std::string logs = runPair("events");
  EXPECT_NE(logs.find("signalled by interprocess CUDA events (DISTILL_CUDA_IPC_SIGNAL=events)"), std::string::npos)
      << logs;
  EXPECT_EQ(logs.find("signalled by stream memory operations"), std::string::npos) << logs;
}
