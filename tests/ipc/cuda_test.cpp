// CUDA IPC buffers between two real processes. The test re-executes its own
// binary (fork+exec, never a plain fork once CUDA is in play) in a role:
// IpcCudaRole.{Student,Teacher} run only when DISTILL_IPC_CUDA_SEGMENT is set.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

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

TEST(IpcCuda, TensorsTravelThroughCudaIpcBuffers) {
  if (roleSegment()) GTEST_SKIP() << "role process";
  if (visibleDevices() == 0) GTEST_SKIP() << "no CUDA device visible";
  ScopedName sn;
  SegmentLayout l = smallLayout();
  l.maxRequestBytes = l.maxResponseBytes = 4 << 20;
  auto seg = Segment::create(sn.name, l, kJob);
  const std::string exe = selfExe();
  std::map<std::string, std::string> env{{"DISTILL_IPC_CUDA_SEGMENT", sn.name}};
  auto teacher = distill::testing::spawn({exe, "--gtest_filter=IpcCudaRole.Teacher"}, env);
  auto student = distill::testing::spawn({exe, "--gtest_filter=IpcCudaRole.Student"}, env);
  EXPECT_EQ(student.join(120s).code, 0);
  EXPECT_EQ(teacher.join(60s).code, 0);
}
