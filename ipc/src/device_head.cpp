// The teacher's head on a GPU, one copy per node and device (device_head.h):
// the record in /dev/shm, the election, the waits and the release. The memory
// is device_memory.h's: CUDA's (cuda/device_head_cuda.cpp), or a test's.
#include "distill/ipc/device_head.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <new>
#include <utility>

#include "distill/build_config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/sys.h"
#include "device_memory.h"
#include "sys.h"

namespace distill::ipc {

namespace {

constexpr uint64_t kMagic = 0x3144454844544944ull; // "DITDHED1", little endian
constexpr uint32_t kVersion = 1;
constexpr size_t kRecordBytes = 4096;

enum : uint32_t { kWriting = 0, kReady = 1, kFailed = 2, kReleased = 3 };

// One page in /dev/shm; written by the owner before `complete` = kReady (release).
struct Record {
  uint64_t magic;
  uint32_t version;
  int32_t ownerPid;
  uint64_t generation; // of the host head copied
  uint64_t weightBytes, biasBytes;
  char fingerprint[65]; // the host head's SHA-256, hex, NUL-terminated
  uint8_t handle[DeviceMemory::kHandleBytes]; // the allocation's (CUDA: cudaIpcMemHandle_t)
  std::atomic<uint32_t> complete; // kWriting, kReady, kFailed, kReleased
  std::atomic<uint32_t> readers; // importers holding the memory
  char why[1024]; // kFailed: the owner's reason
};
static_assert(sizeof(Record) <= kRecordBytes, "one page");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words");

std::string shmPath(const std::string& name) { return "/dev/shm/" + name; }

// A page of /dev/shm mapped read-write; unmapped at destruction.
struct Page {
  void* base = MAP_FAILED;
  ~Page() { reset(); }
  void reset() {
    if (base != MAP_FAILED) ::munmap(base, kRecordBytes);
    base = MAP_FAILED;
  }
  Record& rec() const { return *static_cast<Record*>(base); }
};

void mapPage(Page& p, int fd, const std::string& path) {
  p.base = ::mmap(nullptr, kRecordBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  DISTILL_CHECK_T(IpcError, p.base != MAP_FAILED, "device head: cannot map '", path, "': ", errnoString(errno));
}

} // namespace

struct DeviceHead::State {
  const DeviceMemory* mem = nullptr; // whose memory (set at share)
  std::string name; // the record's name in /dev/shm
  std::string who; // "student rank 3"
  Page page;
  int device = 0;
  bool owner = false;
  void* data = nullptr; // device memory: weight, then bias
  uint64_t weightBytes = 0, biasBytes = 0;
  std::chrono::milliseconds releaseTimeout{0};

  ~State();
};

DeviceHead::State::~State() {
  if (page.base == MAP_FAILED) return;
  Record& r = page.rec();
  if (!owner) {
    if (data) mem->closeImported(device, data, name);
    r.readers.fetch_sub(1);
    sys::futexWakeAll(&r.readers);
    return;
  }
  r.complete.store(kReleased); // seq_cst: an importer counted after this sees it and backs off
  sys::futexWakeAll(&r.complete);
  const Deadline until = Deadline::after(releaseTimeout);
  for (uint32_t n = r.readers.load(); n != 0; n = r.readers.load()) {
    if (until.expired()) {
      DISTILL_LOG(kWarning) << who << ": " << n << " student(s) still hold the device copy of the teacher's head '"
                            << shmPath(name) << "' after " << releaseTimeout.count()
                            << " ms (killed?): freeing it all the same";
      break;
    }
    sys::futexWait(&r.readers, n, std::min<Clock::duration>(std::chrono::milliseconds(200), until.remaining()));
  }
  if (data) mem->freeExported(device, data, name);
  ::unlink(shmPath(name).c_str());
}

bool DeviceHead::available() { return deviceMemory().available(); }

std::string DeviceHead::recordName(const std::string& segmentName, const std::string& uuidHex, uint64_t generation) {
  return headObjectName(segmentName) + ".cuda-" + uuidHex + "-g" + std::to_string(generation);
}

namespace {

// The owner: a full page under a temporary name, initialised, then link(2)ed to `name` (EEXIST: another
// student of the device won). Returns the fd of the record, or an empty Fd when another won.
Fd createRecord(const std::string& name, const SharedHead& host, uint64_t weightBytes, uint64_t biasBytes,
                const std::string& who) {
  static std::atomic<int> counter{0};
  const std::string tmp = name + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  auto [fd, mapped] = sys::createShmObject(tmp, kRecordBytes, who);
  Page p;
  p.base = mapped;
  Record& r = *new (p.base) Record{};
  r.magic = kMagic;
  r.version = kVersion;
  r.ownerPid = ::getpid();
  r.generation = host.generation();
  r.weightBytes = weightBytes;
  r.biasBytes = biasBytes;
  std::snprintf(r.fingerprint, sizeof r.fingerprint, "%s", host.fingerprint().c_str());
  const int linked = ::link(shmPath(tmp).c_str(), shmPath(name).c_str()) == 0 ? 0 : errno;
  ::unlink(shmPath(tmp).c_str());
  if (linked == EEXIST) return Fd();
  DISTILL_CHECK_T(IpcError, linked == 0, who, ": cannot publish '", shmPath(name), "': ", errnoString(linked));
  return std::move(fd); // a structured binding: no implicit move
}

// An importer: waits until the owner made the copy (or failed, or died, or the deadline passed).
void awaitReady(Record& r, const std::string& name, const std::string& who, Deadline deadline,
                const DeviceMemory& mem) {
  const auto start = Clock::now();
  if (r.complete.load(std::memory_order_acquire) == kWriting) mem.awaiting();
  for (uint32_t c = r.complete.load(std::memory_order_acquire); c == kWriting;
       c = r.complete.load(std::memory_order_acquire)) {
    DISTILL_CHECK_T(IpcError, sys::pidState(r.ownerPid) != sys::PidState::kGone, who,
                    ": the student (pid ", r.ownerPid, ") copying the teacher's head to this device ('",
                    shmPath(name), "') died before it shared it");
    if (deadline.expired()) {
      DISTILL_THROW(TimeoutError, awaiting("the device copy of the teacher's head '" + shmPath(name) + "'"), who,
                    " waited ", toMs(Clock::now() - start), " ms for pid ", r.ownerPid,
                    " to copy the teacher's head to this device ('", shmPath(name), "')");
    }
    sys::futexWait(&r.complete, kWriting,
                   std::min<Clock::duration>(std::chrono::milliseconds(200), deadline.remaining()));
  }
}

} // namespace

DeviceHead DeviceHead::share(const std::string& segmentName, const SharedHead& host, int device,
                             const HeadReader& reader, Deadline deadline, std::chrono::milliseconds releaseTimeout) {
  const std::string who = detail::str(reader.role, " rank ", reader.rank);
  DISTILL_CHECK_T(UsageError, available(), who, ": the teacher's head cannot be shared on a GPU: distill was built "
                  "without CUDA");
  auto s = std::make_shared<State>();
  s->mem = &deviceMemory();
  s->who = who;
  s->device = device;
  s->releaseTimeout = releaseTimeout;
  s->weightBytes = uint64_t(host.vocab() * host.dim() * headItemSize(host.dtype()));
  s->biasBytes = host.hasBias() ? uint64_t(host.vocab() * headItemSize(host.dtype())) : 0;
  s->name = recordName(segmentName, s->mem->uuidHex(device), host.generation());
  Fd fd = createRecord(s->name, host, s->weightBytes, s->biasBytes, who);
  if (fd) { // the owner: copy, export, tell
    mapPage(s->page, fd.get(), shmPath(s->name));
    Record& r = s->page.rec();
    s->owner = true;
    try {
      s->data = s->mem->copyAndExport(device, host.weight(), s->weightBytes, host.bias(), s->biasBytes, r.handle,
                                    shmPath(s->name));
    } catch (const std::exception& e) {
      std::snprintf(r.why, sizeof r.why, "%s", e.what());
      r.complete.store(kFailed, std::memory_order_release);
      sys::futexWakeAll(&r.complete);
      ::unlink(shmPath(s->name).c_str());
      s->page.reset(); // nothing to release: the State's destructor does nothing
      throw;
    }
    r.complete.store(kReady, std::memory_order_release);
    sys::futexWakeAll(&r.complete);
    return DeviceHead(std::move(s));
  }
  Fd in(sys::retryEintr([&] { return ::open(shmPath(s->name).c_str(), O_RDWR | O_CLOEXEC); }));
  DISTILL_CHECK_T(IpcError, bool(in), who, ": cannot open '", shmPath(s->name), "': ", errnoString(errno));
  mapPage(s->page, in.get(), shmPath(s->name));
  Record& r = s->page.rec();
  DISTILL_CHECK_T(IpcError, r.magic == kMagic && r.version == kVersion, who, ": '", shmPath(s->name),
                  "' is not a device head record of this build");
  r.readers.fetch_add(1); // counted before the state is read: the owner's release waits for us
  try {
    awaitReady(r, s->name, who, deadline, *s->mem);
    const uint32_t c = r.complete.load();
    DISTILL_CHECK_T(IpcError, c != kFailed, who, ": the student (pid ", r.ownerPid,
                    ") copying the teacher's head to this device failed: ", std::string(r.why, strnlen(r.why, sizeof r.why)));
    DISTILL_CHECK_T(IpcError, c == kReady, who, ": the device copy of the teacher's head '", shmPath(s->name),
                    "' was already released by its owner (pid ", r.ownerPid, ")");
    const std::string fp(r.fingerprint, strnlen(r.fingerprint, sizeof r.fingerprint));
    DISTILL_CHECK_T(IpcError, fp == host.fingerprint() && r.weightBytes == s->weightBytes && r.biasBytes == s->biasBytes,
                    who, ": the device copy '", shmPath(s->name), "' holds head ", fp, " (", r.weightBytes, " + ",
                    r.biasBytes, " bytes), the head mapped here is ", host.fingerprint(), " (", s->weightBytes, " + ",
                    s->biasBytes, " bytes)");
    s->data = s->mem->importHandle(device, r.handle, shmPath(s->name));
  } catch (...) {
    r.readers.fetch_sub(1);
    sys::futexWakeAll(&r.readers);
    s->page.reset();
    throw;
  }
  return DeviceHead(std::move(s));
}

void* DeviceHead::weight() const { return s_->data; }
void* DeviceHead::bias() const { return s_->biasBytes ? static_cast<char*>(s_->data) + s_->weightBytes : nullptr; }
int DeviceHead::device() const { return s_->device; }
bool DeviceHead::owner() const { return s_->owner; }
const std::string& DeviceHead::recordName() const { return s_->name; }
std::shared_ptr<const void> DeviceHead::keepAlive() const { return s_; }

namespace {
const DeviceMemory* testMemory = nullptr;
} // namespace

void setDeviceMemoryForTests(const DeviceMemory* m) { testMemory = m; }
const DeviceMemory& deviceMemory() { return testMemory ? *testMemory : cudaDeviceMemory(); }

#if !DISTILL_CUDA
namespace {
// Without CUDA: available() is false and share() refuses before any of the others.
class NoCuda final : public DeviceMemory {
 public:
  bool available() const override { return false; }
  std::string uuidHex(int) const override { DISTILL_THROW(UsageError, "built without CUDA"); }
  void* copyAndExport(int, const void*, size_t, const void*, size_t, uint8_t*, const std::string&) const override {
    DISTILL_THROW(UsageError, "built without CUDA");
  }
  void* importHandle(int, const uint8_t*, const std::string&) const override {
    DISTILL_THROW(UsageError, "built without CUDA");
  }
  void closeImported(int, void*, const std::string&) const override {}
  void freeExported(int, void*, const std::string&) const override {}
};
} // namespace

const DeviceMemory& cudaDeviceMemory() {
  static const NoCuda m;
  return m;
}
#endif

} // namespace distill::ipc
