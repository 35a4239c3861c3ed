// The TeacherHead a CPU student builds over the node's one mapping of the
// teacher's head (student/teacher_head.h): views, not copies, that outlive the
// object's name; the loss reads them; a restarted teacher's head is checked by
// fingerprint (refused or adopted), with real processes; on a GPU, the students
// of one device share one copy of it (ipc/device_head.h).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>

#include "distill/core/errors.h"
#include "distill/ipc/segment.h"
#include "distill/student/teacher_head.h"
#include "head_test_util.h"
#include "support/process.h"

using namespace distill;
using namespace distill::ipc::test;
using distill::testing::forkChild;
using namespace std::chrono_literals;

namespace {

struct ScopedHeadName {
  std::string name = distill::testing::uniqueName("distill-headview");
  ~ScopedHeadName() { ipc::Segment::remove(name); }
};

const ipc::HeadReader kStudent{2, "student"};

// A teacher process publishes `head` and exits.
void publishFromTeacher(const std::string& seg, const TestHead& head) {
  auto st = forkChild([&] {
    ipc::SharedHead::publish(seg, head.bytes);
    return 0;
  }).join(20s);
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

} // namespace

TEST(TeacherHeadView, TensorsAreViewsOverTheMappingThatOutliveIt) {
  ScopedHeadName sn;
  TestHead src(48, 16, 1.0f, true, 30.0, 0.5);
  publishFromTeacher(sn.name, src);
  auto mapped = MappedTeacherHead::open(sn.name, kStudent, Deadline::after(10s));
  TeacherHead head = mapped.head();
  EXPECT_EQ(head.weight.sizes(), (at::IntArrayRef{48, 16}));
  EXPECT_EQ(head.weight.data_ptr(), mapped.shared().weight()); // no copy
  EXPECT_EQ(head.bias.data_ptr(), mapped.shared().bias());
  EXPECT_TRUE(at::equal(head.weight, at::from_blob(src.weight.data(), {48, 16}, at::kFloat)));
  EXPECT_TRUE(at::equal(head.bias, at::from_blob(src.bias.data(), {48}, at::kFloat)));
  EXPECT_EQ(head.softcap, 30.0);
  EXPECT_EQ(head.scale, 0.5);
  // The loss's materialised path reads the mapped head as any other.
  auto hidden = at::randn({5, 16});
  auto expect = 30.0 * at::tanh((at::linear(hidden, head.weight.clone(), head.bias.clone()) * 0.5) / 30.0);
  EXPECT_TRUE(at::allclose(teacherLogits(hidden, head), expect, 1e-5, 1e-5));
  // The tensors hold the mapping: valid after the name and the handle are gone.
  { auto drop = std::move(mapped); }
  ipc::Segment::remove(sn.name);
  EXPECT_TRUE(at::equal(head.weight, at::from_blob(src.weight.data(), {48, 16}, at::kFloat)));
}

TEST(TeacherHeadView, AHeadChangeAfterARestartIsCaught) {
  ScopedHeadName sn;
  TestHead first(32, 8, 1.0f, false), same(32, 8, 1.0f, false), other(32, 8, 2.0f, false);
  const std::string fpFirst = ipc::headFingerprint(first.bytes), fpOther = ipc::headFingerprint(other.bytes);
  publishFromTeacher(sn.name, first);
  Signal opened, restarted;
  auto refusing = forkChild([&] {
    auto mapped = MappedTeacherHead::open(sn.name, kStudent, Deadline::after(10s), HeadChange::kRefuse);
    opened.signal();
    // Restart 1 republishes the same head: adopted silently (the old object is then freed).
    if (mapped.awaitRepublished(Deadline::after(20s)) || mapped.shared().generation() != 2) return 2;
    opened.signal();
    try {
      mapped.awaitRepublished(Deadline::after(20s)); // restart 2: another head
    } catch (const IpcError& e) {
      const std::string m = e.what();
      const bool named = contains(m, "student rank 2") && contains(m, fpFirst) && contains(m, fpOther) &&
          contains(m, "changed after a teacher restart");
      if (!named) std::fprintf(stderr, "message: %s\n", e.what());
      // The head held stays the old one.
      return named && mapped.fingerprint() == fpFirst && mapped.head().weight[0][0].item<float>() == 1.0f ? 0 : 3;
    }
    return 4;
  });
  ASSERT_TRUE(opened.wait(Deadline::after(20s)));
  publishFromTeacher(sn.name, same);
  ASSERT_TRUE(opened.wait(Deadline::after(20s)));
  publishFromTeacher(sn.name, other);
  auto st = refusing.join(30s);
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe();

  // kAdopt: the student maps the new head and sees its values.
  auto adopting = MappedTeacherHead::open(sn.name, kStudent, Deadline::after(10s), HeadChange::kAdopt);
  EXPECT_FALSE(adopting.checkForChange());
  publishFromTeacher(sn.name, first);
  EXPECT_TRUE(adopting.checkForChange());
  EXPECT_EQ(adopting.fingerprint(), fpFirst);
  EXPECT_EQ(adopting.head().weight[0][0].item<float>(), 1.0f);
  EXPECT_EQ(adopting.shared().generation(), 4u);
}

// The head on a GPU (ipc/device_head.h): the two students of one device share one copy, the first
// making it and the other importing it by CUDA IPC; both read the mapped head's values; the copy
// is freed and its record unlinked once both let go. Each student is its own process and the test
// process never initialises CUDA (a fork after it is undefined). Skipped without an NVIDIA device.
TEST(TeacherHeadOnDevice, TheStudentsOfOneGpuShareOneCopy) {
  if (::access("/dev/nvidiactl", F_OK) != 0) GTEST_SKIP() << "no NVIDIA device (/dev/nvidiactl)";
  ScopedHeadName sn;
  TestHead src(48, 16, 1.0f, true);
  publishFromTeacher(sn.name, src);
  Signal shared, release;
  auto student = [&](int rank) {
    return forkChild([&, rank] {
      const ipc::HeadReader reader{rank, "student"};
      auto mapped = MappedTeacherHead::open(sn.name, reader, Deadline::after(10s));
      int code = 1;
      {
        ipc::DeviceHead d = ipc::DeviceHead::share(sn.name, mapped.shared(), 0, reader, Deadline::after(60s));
        const auto on = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0);
        const at::Tensor w = at::from_blob(d.weight(), {48, 16}, on).cpu();
        const at::Tensor b = at::from_blob(d.bias(), {48}, on).cpu();
        if (at::equal(w, mapped.head().weight) && at::equal(b, mapped.head().bias)) code = d.owner() ? 10 : 11;
        shared.signal();
        if (!release.wait(Deadline::after(60s))) return 2;
      } // the importer lets go; the owner waits for it, then frees the copy and unlinks the record
      return code;
    });
  };
  auto a = student(0), b = student(1);
  ASSERT_TRUE(shared.wait(Deadline::after(90s)));
  ASSERT_TRUE(shared.wait(Deadline::after(90s)));
  release.signal();
  release.signal();
  auto sa = a.join(90s), sb = b.join(90s);
  ASSERT_TRUE(sa.exited && sb.exited) << sa.describe() << "; " << sb.describe();
  EXPECT_EQ(std::min(sa.code, sb.code), 10) << sa.describe() << "; " << sb.describe(); // one made the copy
  EXPECT_EQ(std::max(sa.code, sb.code), 11) << sa.describe() << "; " << sb.describe(); // the other imported it
  EXPECT_TRUE(shmObjects(sn.name + ".head.cuda-").empty());
}

// Where no GPU can be used, sharing the head on one is an error naming why (the student then copies
// the head for itself, teacherHeadOn), and no record is left behind.
TEST(TeacherHeadOnDevice, WithoutAGpuSharingIsAnErrorNamingWhy) {
  if (::access("/dev/nvidiactl", F_OK) == 0) GTEST_SKIP() << "an NVIDIA device is present (the test above shares)";
  ScopedHeadName sn;
  TestHead src(8, 4, 1.0f, false);
  publishFromTeacher(sn.name, src);
  auto mapped = MappedTeacherHead::open(sn.name, kStudent, Deadline::after(10s));
  try {
    ipc::DeviceHead::share(sn.name, mapped.shared(), 0, kStudent, Deadline::after(5s));
    ADD_FAILURE() << "shared a head on a machine without an NVIDIA device";
  } catch (const Error& e) {
    const std::string m = e.message();
    EXPECT_TRUE(ipc::DeviceHead::available() ? contains(m, "cuda:0") : contains(m, "without CUDA")) << m;
  }
  EXPECT_TRUE(shmObjects(sn.name + ".head.cuda-").empty());
}
