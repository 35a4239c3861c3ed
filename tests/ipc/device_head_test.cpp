// The device head's record, election, waits and release (ipc/device_head.h)
// with real processes and no GPU: the memory is POSIX shared memory standing
// in for CUDA's (ipc/src/device_memory.h's seam), exported by its name. What
// CUDA itself does is tests/student/teacher_head_test.cpp's GPU test.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>

#include "device_memory.h"
#include "distill/core/errors.h"
#include "distill/ipc/device_head.h"
#include "distill/ipc/segment.h"
#include "head_test_util.h"
#include "support/process.h"
#include "sys.h"

using distill::testing::forkChild;
using namespace std::chrono_literals;
using namespace distill;
using namespace distill::ipc;
using namespace distill::ipc::test;

namespace {

// "Device memory" that another process imports by name: a /dev/shm object per allocation.
class HostMemory final : public DeviceMemory {
 public:
  enum class Copy { kOk, kFail, kHang }; // kFail: an IpcError; kHang: blocks (the test kills it)
  Copy copy = Copy::kOk;
  const Signal* inCopy = nullptr; // signalled when the copy starts
  const Signal* go = nullptr; // kFail waits for it before failing
  const Signal* waits = nullptr; // signalled when this student starts waiting for the owner

  bool available() const override { return true; }
  std::string uuidHex(int device) const override { return "5e57" + std::to_string(device); }
  void* copyAndExport(int, const void* weight, size_t weightBytes, const void* bias, size_t biasBytes,
                      uint8_t* handle, const std::string& what) const override {
    if (inCopy) inCopy->signal();
    if (copy == Copy::kHang) ::pause();
    if (copy == Copy::kFail) {
      if (go) (void)go->wait(Deadline::after(30s));
      DISTILL_THROW(IpcError, "planted copy failure (", what, ")");
    }
    static std::atomic<int> n{0};
    const std::string name = "distill-devmem-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
    auto [fd, p] = sys::createShmObject(name, weightBytes + biasBytes, "test memory");
    std::memcpy(p, weight, weightBytes);
    if (biasBytes) std::memcpy(static_cast<char*>(p) + weightBytes, bias, biasBytes);
    std::memset(handle, 0, kHandleBytes);
    std::snprintf(reinterpret_cast<char*>(handle), kHandleBytes, "%s", name.c_str());
    regions[p] = {name, weightBytes + biasBytes};
    return p;
  }
  void* importHandle(int, const uint8_t* handle, const std::string&) const override {
    const std::string name(reinterpret_cast<const char*>(handle));
    Fd fd(::open(("/dev/shm/" + name).c_str(), O_RDWR | O_CLOEXEC));
    struct stat st {};
    DISTILL_CHECK_T(IpcError, fd && ::fstat(fd.get(), &st) == 0, "cannot import ", name);
    void* p = ::mmap(nullptr, size_t(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    regions[p] = {name, size_t(st.st_size)};
    return p;
  }
  void awaiting() const override {
    if (waits) waits->signal();
  }
  void closeImported(int, void* p, const std::string&) const override { ::munmap(p, regions.at(p).second); }
  void freeExported(int, void* p, const std::string&) const override {
    ::munmap(p, regions.at(p).second);
    ::unlink(("/dev/shm/" + regions.at(p).first).c_str());
  }

 private:
  mutable std::map<void*, std::pair<std::string, size_t>> regions;
};

struct ScopedHead {
  std::string name = distill::testing::uniqueName("distill-devhead");
  ~ScopedHead() { Segment::remove(name); }
};

// A page every process of a test shares (created before the forks).
struct SharedFlags {
  std::atomic<int>* f = static_cast<std::atomic<int>*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ~SharedFlags() { ::munmap(f, 4096); }
};

constexpr int64_t kVocab = 64, kDim = 32;

// Student `rank` shares the head published beside `seg` with `mem` (the process's memory from now on).
std::optional<DeviceHead> share(const std::string& seg, int rank, HostMemory& mem,
                                std::chrono::milliseconds releaseTimeout = 30000ms) {
  setDeviceMemoryForTests(&mem);
  auto host = SharedHead::open(seg, HeadReader{rank, "student"}, Deadline::after(10s));
  return DeviceHead::share(seg, host, 0, HeadReader{rank, "student"}, Deadline::after(60s), releaseTimeout);
}

// Whether `d` holds the published head's bytes.
bool sameBytes(const DeviceHead& d, const TestHead& src) {
  return std::memcmp(d.weight(), src.weight.data(), src.weight.size() * 4) == 0 &&
      std::memcmp(d.bias(), src.bias.data(), src.bias.size() * 4) == 0;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A head published beside a fresh segment name, removed after the test.
class DeviceHeadTest : public ::testing::Test {
 protected:
  void SetUp() override { SharedHead::publish(sh.name, src.bytes); }
  ScopedHead sh;
  TestHead src{kVocab, kDim, 1.0f, true};
};

} // namespace

// Two students of one device: one makes the copy, the other imports it; both read the published
// head's bytes. The owner frees the copy only after the importer let go (the importer's flag, set
// just before it lets go, is seen by the owner once its release returns); then neither the record
// nor the memory is left.
TEST_F(DeviceHeadTest, TwoStudentsShareOneCopyAndTheOwnerFreesItAfterTheLast) {
  SharedFlags flags; // [0]: the importer let go
  Signal madeCopy, imported, releasing;
  auto owner = forkChild([&] {
    HostMemory mem;
    {
      auto d = share(sh.name, 0, mem);
      if (!d->owner() || !sameBytes(*d, src)) return 2;
      madeCopy.signal();
      if (!imported.wait(Deadline::after(60s))) return 3;
      releasing.signal();
    } // waits for the importer to let go
    return flags.f[0].load() == 1 ? 0 : 4;
  });
  ASSERT_TRUE(madeCopy.wait(Deadline::after(60s)));
  auto importer = forkChild([&] {
    HostMemory mem;
    auto d = share(sh.name, 1, mem);
    if (d->owner() || !sameBytes(*d, src)) return 2;
    imported.signal();
    if (!releasing.wait(Deadline::after(60s))) return 3;
    if (!sameBytes(*d, src)) return 4; // the owner is releasing: the copy is still there
    flags.f[0].store(1);
    return 0; // lets go at exit of this scope
  });
  const int ownerPid = owner.pid();
  auto so = owner.join(90s), si = importer.join(90s);
  EXPECT_TRUE(so.exited && so.code == 0) << so.describe();
  EXPECT_TRUE(si.exited && si.code == 0) << si.describe();
  EXPECT_TRUE(shmObjects(sh.name + ".head.cuda-").empty());
  EXPECT_TRUE(shmObjects("distill-devmem-" + std::to_string(ownerPid) + "-").empty());
}

// The owner killed while it copies: a student waiting for it learns it at once from the kernel,
// not at its deadline (60 s), with an error naming the owner and the record.
TEST_F(DeviceHeadTest, AnOwnerKilledBeforeItSharedIsReportedAtOnce) {
  Signal inCopy, waiting;
  auto owner = forkChild([&] {
    HostMemory mem;
    mem.copy = HostMemory::Copy::kHang;
    mem.inCopy = &inCopy;
    share(sh.name, 0, mem);
    return 2;
  });
  ASSERT_TRUE(inCopy.wait(Deadline::after(60s)));
  auto waiter = forkChild([&] {
    HostMemory mem;
    const auto start = Clock::now();
    try {
      waiting.signal();
      share(sh.name, 1, mem);
    } catch (const IpcError& e) {
      const std::string m = e.message();
      const bool named = contains(m, "student rank 1") && contains(m, "died before it shared it") &&
          contains(m, ".head.cuda-");
      if (!named) std::fprintf(stderr, "message: %s\n", m.c_str());
      return named && Clock::now() - start < 20s ? 0 : 3;
    }
    return 4;
  });
  ASSERT_TRUE(waiting.wait(Deadline::after(60s)));
  owner.kill(SIGKILL);
  auto sw = waiter.join(60s);
  owner.join(10s);
  EXPECT_TRUE(sw.exited && sw.code == 0) << sw.describe();
}

// The owner's copy fails: the students waiting for it get its reason; the record is gone, so a
// later student starts again (and here makes the copy itself).
TEST_F(DeviceHeadTest, AFailedCopyIsEveryWaitersErrorAndTheNextStudentTriesAgain) {
  Signal inCopy, go, waiting;
  auto owner = forkChild([&] {
    HostMemory mem;
    mem.copy = HostMemory::Copy::kFail;
    mem.inCopy = &inCopy;
    mem.go = &go;
    try {
      share(sh.name, 0, mem);
    } catch (const IpcError& e) {
      return contains(e.message(), "planted copy failure") ? 0 : 3;
    }
    return 2;
  });
  ASSERT_TRUE(inCopy.wait(Deadline::after(60s)));
  auto waiter = forkChild([&] {
    HostMemory mem;
    mem.waits = &waiting; // the owner fails only once this student waits for it
    try {
      share(sh.name, 1, mem);
    } catch (const IpcError& e) {
      const std::string m = e.message();
      if (!contains(m, "failed: ") || !contains(m, "planted copy failure")) std::fprintf(stderr, "%s\n", m.c_str());
      return contains(m, "planted copy failure") ? 0 : 3;
    }
    return 4;
  });
  ASSERT_TRUE(waiting.wait(Deadline::after(60s)));
  go.signal();
  auto so = owner.join(60s), sw = waiter.join(60s);
  EXPECT_TRUE(so.exited && so.code == 0) << so.describe();
  EXPECT_TRUE(sw.exited && sw.code == 0) << sw.describe();
  auto next = forkChild([&] {
    HostMemory mem;
    auto d = share(sh.name, 2, mem);
    return d->owner() && sameBytes(*d, src) ? 0 : 2;
  }).join(60s);
  EXPECT_TRUE(next.exited && next.code == 0) << next.describe();
}

// An importer killed while it holds the copy never lets go: the owner frees the copy after its
// release timeout all the same, and leaves nothing behind.
TEST_F(DeviceHeadTest, AKilledImporterDoesNotHoldTheOwnerPastItsTimeout) {
  Signal madeCopy, imported, release;
  auto owner = forkChild([&] {
    HostMemory mem;
    const auto start = Clock::now();
    {
      auto d = share(sh.name, 0, mem, 500ms);
      madeCopy.signal();
      if (!release.wait(Deadline::after(60s))) return 3;
    }
    return Clock::now() - start < 30s ? 0 : 4;
  });
  ASSERT_TRUE(madeCopy.wait(Deadline::after(60s)));
  auto importer = forkChild([&] {
    HostMemory mem;
    auto d = share(sh.name, 1, mem);
    imported.signal();
    ::pause(); // killed while it holds the copy
    return 2;
  });
  ASSERT_TRUE(imported.wait(Deadline::after(60s)));
  importer.kill(SIGKILL);
  importer.join(10s);
  release.signal();
  const int ownerPid = owner.pid();
  auto so = owner.join(60s);
  EXPECT_TRUE(so.exited && so.code == 0) << so.describe();
  EXPECT_TRUE(shmObjects(sh.name + ".head.cuda-").empty());
  EXPECT_TRUE(shmObjects("distill-devmem-" + std::to_string(ownerPid) + "-").empty());
}

// A republished head (a teacher restart) has a record and a copy of its own, named by its generation.
TEST(DeviceHead, ARepublishedHeadGetsItsOwnCopy) {
  ScopedHead sh;
  TestHead first(kVocab, kDim, 1.0f, true), second(kVocab, kDim, 2.0f, true);
  SharedHead::publish(sh.name, first.bytes);
  auto st = forkChild([&] {
    HostMemory mem;
    auto a = share(sh.name, 0, mem);
    SharedHead::publish(sh.name, second.bytes);
    auto b = share(sh.name, 0, mem);
    const bool named = contains(a->recordName(), "-g1") && contains(b->recordName(), "-g2");
    return named && a->owner() && b->owner() && sameBytes(*a, first) && sameBytes(*b, second) ? 0 : 2;
  }).join(60s);
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe();
  EXPECT_TRUE(shmObjects(sh.name + ".head.cuda-").empty());
}
