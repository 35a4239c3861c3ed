// The teacher's head published once per node (ipc/shared_head.h), with real
// processes: a teacher publishes, two students map the one copy (measured by
// proportional set size and /dev/shm), a republish is seen as a newer
// generation with another fingerprint, a corrupt or truncated object is
// refused without a crash, and the object goes with its segment.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>

#include "distill/core/errors.h"
#include "distill/ipc/segment.h"
#include "head_test_util.h"
#include "support/process.h"
#include "wire.h"

using namespace distill;
using namespace distill::ipc;
using namespace distill::ipc::test;
using distill::testing::forkChild;
using namespace std::chrono_literals;

namespace {

// A unique segment name whose segment and head objects are removed at the end.
struct ScopedHeadName {
  std::string name = distill::testing::uniqueName("distill-headtest");
  ~ScopedHeadName() {
    Segment::remove(name);
    EXPECT_TRUE(shmObjects(name).empty()) << name << ".head* left behind in /dev/shm";
  }
};

constexpr int64_t kVocab = 1024, kDim = 512; // 2 MiB of float32

// Student: maps the head, checks every value against `expect`, then holds it until `release`.
int holdingStudent(const std::string& seg, int rank, const Signal& ready, const Signal& release) {
  auto h = SharedHead::open(seg, HeadReader{rank, "student"}, Deadline::after(20s));
  TestHead expect(kVocab, kDim, 1.0f, true);
  if (std::memcmp(h.weight(), expect.weight.data(), expect.weight.size() * 4) != 0) return 3;
  if (std::memcmp(h.bias(), expect.bias.data(), expect.bias.size() * 4) != 0) return 4;
  if (h.vocab() != kVocab || h.dim() != kDim || h.dtype() != HeadDType::kFloat32) return 5;
  if (h.fingerprint() != headFingerprint(expect.bytes)) return 6;
  ready.signal();
  return release.wait(Deadline::after(30s)) ? 0 : 7;
}

// Opens the head in a child (a SIGBUS there fails the test, not the binary) and
// expects an IpcError whose message holds every part of `parts`.
void expectRefused(const std::string& seg, const std::vector<std::string>& parts) {
  auto child = forkChild([&] {
    try {
      SharedHead::open(seg, HeadReader{3, "student"}, Deadline::after(5s));
    } catch (const IpcError& e) {
      for (auto& p : parts)
        if (std::string(e.what()).find(p) == std::string::npos) {
          std::fprintf(stderr, "'%s' does not name '%s'\n", e.what(), p.c_str());
          return 2;
        }
      return 0;
    }
    return 1;
  });
  auto st = child.join(20s);
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe();
}

std::string headPath(const std::string& seg) { return "/dev/shm/" + headObjectName(seg); }

} // namespace

TEST(SharedHead, OnePublishedCopyMappedReadOnlyByTwoStudents) {
  ScopedHeadName sn;
  Signal ready0, ready1, release;
  // Students first: they wait for the head with a deadline.
  auto s0 = forkChild([&] { return holdingStudent(sn.name, 0, ready0, release); });
  auto s1 = forkChild([&] { return holdingStudent(sn.name, 1, ready1, release); });
  auto teacher = forkChild([&] {
    TestHead head(kVocab, kDim, 1.0f, true);
    SharedHead::publish(sn.name, head.bytes);
    return 0;
  });
  ASSERT_EQ(teacher.join(20s).code, 0);
  ASSERT_TRUE(ready0.wait(Deadline::after(20s)));
  ASSERT_TRUE(ready1.wait(Deadline::after(20s)));

  // The node holds one object of the head's size ...
  auto objects = shmObjects(sn.name);
  ASSERT_EQ(objects.size(), 1u);
  const int64_t bytes = objects[0].second;
  EXPECT_EQ(objects[0].first, headObjectName(sn.name));
  EXPECT_EQ(bytes, int64_t(wire::kHeadHeaderBytes + kVocab * kDim * 4 + kVocab * 4));
  // ... and each student maps all of it but is charged half (two sharers, the teacher gone).
  for (int pid : {s0.pid(), s1.pid()}) {
    const MappingSize m = mappingSize(pid, headPath(sn.name));
    std::printf("student pid %d: head mapping Rss %lld bytes, Pss %lld bytes (object %lld bytes)\n", pid,
                (long long)m.rss, (long long)m.pss, (long long)bytes);
    EXPECT_GE(m.rss, bytes - 4096);
    EXPECT_NEAR(double(m.pss), double(bytes) / 2, 2 * 4096.0);
  }
  release.signal();
  release.signal();
  EXPECT_EQ(s0.join(20s).code, 0);
  EXPECT_EQ(s1.join(20s).code, 0);
}

TEST(SharedHead, RepublishIsANewerGenerationWithAnotherFingerprint) {
  ScopedHeadName sn;
  Signal opened, republished;
  forkChild([&] { return SharedHead::publish(sn.name, TestHead(64, 32, 1.0f, false).bytes).generation() == 1 ? 0 : 1; })
      .join(20s);
  auto student = forkChild([&] {
    auto h = SharedHead::open(sn.name, HeadReader{0, "student"}, Deadline::after(10s));
    if (h.generation() != 1 || h.replaced()) return 2;
    opened.signal();
    if (!republished.wait(Deadline::after(20s)) || !h.replaced()) return 3;
    auto next = SharedHead::open(sn.name, HeadReader{0, "student"}, Deadline::after(10s), h.generation());
    if (next.generation() != 2 || next.fingerprint() == h.fingerprint()) return 4;
    if (next.fingerprint() != headFingerprint(TestHead(64, 32, 2.0f, false, 30.0).bytes)) return 5;
    // The old head stays readable while held, and a newer one than the newest is a timeout.
    if (static_cast<const float*>(h.weight())[1] != 1.0f + 1 / 1024.0f) return 6;
    h.verify();
    next.verify();
    try {
      SharedHead::open(sn.name, HeadReader{0, "student"}, Deadline::after(50ms), next.generation());
    } catch (const TimeoutError& e) {
      return std::string(e.what()).find("student rank 0 waited for a teacher head newer than generation 2") !=
              std::string::npos ? 0 : 7;
    }
    return 8;
  });
  ASSERT_TRUE(opened.wait(Deadline::after(20s)));
  // The "restarted" teacher: another process, another head.
  forkChild([&] { return SharedHead::publish(sn.name, TestHead(64, 32, 2.0f, false, 30.0).bytes).generation() == 2 ? 0 : 1; })
      .join(20s);
  EXPECT_EQ(shmObjects(sn.name).size(), 1u); // the rename replaced the old name
  republished.signal();
  auto st = student.join(30s);
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe();
}

TEST(SharedHead, CorruptTruncatedOrIncompleteObjectIsRefused) {
  ScopedHeadName sn;
  const std::string path = headPath(sn.name);
  auto publish = [&] {
    SharedHead::publish(sn.name, TestHead(256, 64, 1.0f, true).bytes);
    ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  };
  auto patch = [&](size_t offset, const void* bytes, size_t n) {
    int fd = ::open(path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, bytes, n, off_t(offset)), ssize_t(n));
    ::close(fd);
  };
  publish();
  ASSERT_EQ(::truncate(path.c_str(), 4096 + 1000), 0);
  expectRefused(sn.name, {"student rank 3", path, "truncated: the header says", "the object holds 5096"});
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  expectRefused(sn.name, {"student rank 3", "truncated: 100 bytes"});
  publish();
  const uint64_t junk = 0x1234;
  patch(offsetof(wire::HeadHeader, magic), &junk, 8);
  expectRefused(sn.name, {"student rank 3", "bad magic"});
  publish();
  const uint32_t zero = 0;
  patch(offsetof(wire::HeadHeader, complete), &zero, 4);
  expectRefused(sn.name, {"not complete"});
  publish();
  const int64_t vocab = 1 << 30;
  patch(offsetof(wire::HeadHeader, vocab), &vocab, 8);
  expectRefused(sn.name, {"header checksum"});
  // The data changed under a valid header: verify() names both fingerprints.
  publish();
  const float f = 99.0f;
  patch(wire::kHeadHeaderBytes, &f, 4);
  auto h = SharedHead::open(sn.name, HeadReader{0, "student"}, Deadline::after(5s));
  EXPECT_THROW(h.verify(), IpcError);
}

TEST(SharedHead, RemovedWithItsSegmentAndByTheStaleSweep) {
  ScopedHeadName sn;
  SegmentLayout l;
  l.maxRequestBytes = l.maxResponseBytes = 1 << 16;
  Segment::create(sn.name, l, "job-head-test");
  SharedHead::publish(sn.name, TestHead(64, 32, 1.0f, false).bytes);
  // A temporary left by a teacher killed mid-publish.
  ::close(::open(("/dev/shm/" + headObjectName(sn.name) + ".tmp-999999-0").c_str(), O_CREAT | O_WRONLY, 0600));
  ASSERT_EQ(shmObjects(sn.name).size(), 3u);
  EXPECT_TRUE(Segment::remove(sn.name));
  EXPECT_TRUE(shmObjects(sn.name).empty());

  // A head whose segment is gone (a job killed between the two) goes with the next job's sweep.
  SharedHead::publish(sn.name, TestHead(64, 32, 1.0f, false).bytes);
  auto removed = Segment::removeStale(sn.name);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0], headObjectName(sn.name) + " (a teacher head whose segment is gone)");
  EXPECT_TRUE(shmObjects(sn.name).empty());
  // Waiting for a head nobody publishes ends at the deadline, naming the reader and the object.
  try {
    SharedHead::open(sn.name, HeadReader{5, "student"}, Deadline::after(30ms));
    ADD_FAILURE() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("student rank 5 waited for the teacher's head '" + headPath(sn.name)),
              std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("none was published"), std::string::npos) << e.what();
  }
}
