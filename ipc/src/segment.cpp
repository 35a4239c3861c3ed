// A segment's shared-memory mapping (segment.h, segment_impl.h): creating the
// object (stale ones cleared, pages reserved), attaching to one (waiting for it,
// checking its control block against its layout), and the segment's flags.
#include "distill/ipc/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <sstream>
#include <thread>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/ipc/shared_head.h"
#include "segment_impl.h"
#include "sys.h"

namespace bip = boost::interprocess;

namespace distill::ipc {

void SegmentImpl::notify(int index) const {
  wire::ProcessEntry& e = process(index);
  // Pairs with the waiter's sleepers.fetch_add + fence (see port.h): after the
  // caller's release store of the awaited change, this fence orders it before
  // the sleepers load, so either the waiter sees the change or we see it sleeping.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (e.sleepers.load(std::memory_order_acquire) != 0) {
    e.doorbell.fetch_add(1, std::memory_order_release);
    sys::futexWakeAll(&e.doorbell);
  }
}

void SegmentImpl::notifyAll() const {
  for (int i = 0; i < numProcesses(); ++i) notify(i);
}

namespace {

struct Mapping {
  bip::shared_memory_object shm;
  bip::mapped_region region;
};

// "570425344 bytes (544.0 MiB)"
std::string bytesText(uint64_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%llu bytes (%.1f MiB)", static_cast<unsigned long long>(n), double(n) / (1 << 20));
  return buf;
}

// Which keys set a segment's size, with their values, for the "too big" error.
std::string sizeKeys(const SegmentLayout& l) {
  return detail::str("lower transport.slots (", l.slots, "), transport.max_request_bytes (", l.maxRequestBytes,
                     ") or transport.max_response_bytes (", l.maxResponseBytes, "), or run fewer students per node (",
                     l.numStudents,
                     "; each needs transport.slots x (request + response) bytes), or give /dev/shm more room");
}

// Bytes free for an unprivileged writer in the file system that holds the
// segments; -1 if it cannot be asked.
int64_t shmBytesFree() {
  struct statvfs st {};
  if (sys::retryEintr([&] { return ::statvfs("/dev/shm", &st); }) != 0) return -1;
  return int64_t(st.f_bavail) * int64_t(st.f_frsize);
}

// Reserves every page of the segment now, so that no write into it can later
// fail. A tmpfs page is allocated on first touch; when the file system is full
// by then, the writer gets SIGBUS (an 8 MiB /dev/shm killed the teacher at step
// 3). posix_fallocate allocates them all at creation, or fails with ENOSPC here,
// where it can be reported. Returns 0 or the error number.
int reservePages(const bip::shared_memory_object& shm, uint64_t bytes) {
  const int fd = shm.get_mapping_handle().handle;
  int err;
  do {
    err = ::posix_fallocate(fd, 0, off_t(bytes));
  } while (err == EINTR);
  return err;
}

// Maps an existing segment read-write; nullptr if it does not exist (yet).
std::shared_ptr<Mapping> openExisting(const std::string& name) {
  try {
    auto m = std::make_shared<Mapping>();
    m->shm = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write);
    bip::offset_t size = 0;
    if (!m->shm.get_size(size) || size < bip::offset_t(wire::kControlBytes)) return nullptr; // being created
    m->region = bip::mapped_region(m->shm, bip::read_write);
    return m;
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error) return nullptr;
    DISTILL_THROW(IpcError, "segment '", name, "': cannot open: ", e.what());
  }
}

std::shared_ptr<SegmentImpl> makeImpl(const std::string& name, std::shared_ptr<Mapping> m, const SegmentLayout& l) {
  auto impl = std::make_shared<SegmentImpl>();
  impl->name = name;
  impl->base = static_cast<uint8_t*>(m->region.get_address());
  impl->size = m->region.get_size();
  impl->mapping = std::move(m);
  impl->layout = l;
  impl->off = computeOffsets(l);
  return impl;
}

} // namespace

std::vector<std::string> Segment::removeStale(const std::string& prefix) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.compare(0, prefix.size(), prefix) == 0 && n.find(".head") == std::string::npos) names.push_back(n);
    }
    ::closedir(d);
  }
  std::vector<std::string> removed;
  for (auto& n : names) {
    int pid = 0;
    try {
      auto m = openExisting(n);
      if (!m) continue;
      // creatorPid sits at the same offset in every layout version.
      auto& c = *static_cast<const wire::ControlBlock*>(m->region.get_address());
      if (c.magic.load(std::memory_order_acquire) != wire::kSegmentMagic) continue; // not (yet) a segment
      pid = c.creatorPid;
    } catch (const Error&) {
      continue; // not ours to open (another user's, mode 0600)
    }
    if (pid <= 0 || pid == ::getpid() || sys::pidState(pid) != sys::PidState::kGone) continue;
    if (bip::shared_memory_object::remove(n.c_str()))
      removed.push_back(n + " (creator pid " + std::to_string(pid) + ")");
    removeHeadObjects(n);
  }
  for (auto& n : removeOrphanHeads(prefix)) removed.push_back(n + " (a teacher head whose segment is gone)");
  return removed;
}

namespace {

// A segment of this name left by a dead creator is removed; a live one's is an error.
void clearStaleSegment(const std::string& name) {
  if (auto old = openExisting(name)) {
    auto& c = *static_cast<const wire::ControlBlock*>(old->region.get_address());
    const int pid = c.magic.load(std::memory_order_acquire) == wire::kSegmentMagic ? c.creatorPid : 0;
    if (pid > 0 && pid != ::getpid() && sys::pidState(pid) != sys::PidState::kGone)
      DISTILL_THROW(IpcError, "segment '", name, "' already exists and its creator pid ", pid,
                    " is alive (another job on this node with the same name?)");
    if (pid == ::getpid())
      DISTILL_THROW(IpcError, "segment '", name, "' already exists, created by this process (pid ", pid, ")");
    DISTILL_LOG(kWarning) << "segment '" << name << "' is stale (creator pid " << pid
                          << (pid > 0 ? " is dead" : " unknown: never initialised") << "); removing and recreating it";
    bip::shared_memory_object::remove(name.c_str());
  }
}

// A new shared-memory object of off.total bytes, reserved and mapped. With
// `mayExist`, an object of that name made first by another process is no
// error: null (the caller attaches to it instead).
std::shared_ptr<Mapping> createMapping(const std::string& name, const LayoutOffsets& off, const SegmentLayout& layout,
                                       bool mayExist = false) {
  // Room first, for a message that says what to change; the reservation below
  // is what guarantees it (another job may take the room in between). A
  // process that may attach to a segment another made first needs no room:
  // the segment's pages are already reserved.
  struct stat st {};
  if (mayExist && ::stat(("/dev/shm/" + name).c_str(), &st) == 0) return nullptr;
  const int64_t free = shmBytesFree();
  if (free >= 0 && uint64_t(free) < off.total && !(mayExist && ::stat(("/dev/shm/" + name).c_str(), &st) == 0))
    DISTILL_THROW(IpcError, "segment '", name, "' needs ", bytesText(off.total),
                  " of shared memory but /dev/shm has only ", bytesText(uint64_t(free)), " free: ", sizeKeys(layout));
  auto m = std::make_shared<Mapping>();
  try {
    bip::permissions perm(0600);
    m->shm = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write, perm);
    m->shm.truncate(bip::offset_t(off.total)); // zero-filled
  } catch (const bip::interprocess_exception& e) {
    if (mayExist && e.get_error_code() == bip::already_exists_error) return nullptr; // not ours to remove
    bip::shared_memory_object::remove(name.c_str());
    DISTILL_THROW(IpcError, "segment '", name, "': cannot create ", bytesText(off.total), ": ", e.what());
  }
  if (const int err = reservePages(m->shm, off.total)) {
    if (err != EOPNOTSUPP && err != EINVAL) {
      bip::shared_memory_object::remove(name.c_str());
      const int64_t nowFree = shmBytesFree();
      DISTILL_THROW(IpcError, "segment '", name, "': cannot reserve ", bytesText(off.total), " of shared memory (",
                    errnoString(err), "); /dev/shm has ",
                    nowFree >= 0 ? bytesText(uint64_t(nowFree)) : std::string("an unknown number of bytes"),
                    " free: ", sizeKeys(layout));
    }
    // Not a tmpfs that can reserve (never the case for /dev/shm on Linux >= 3.5).
    DISTILL_LOG(kWarning) << "segment '" << name << "': /dev/shm cannot reserve pages (" << errnoString(err)
                          << "); a write may fail with SIGBUS if it fills up";
  }
  try {
    m->region = bip::mapped_region(m->shm, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    bip::shared_memory_object::remove(name.c_str());
    DISTILL_THROW(IpcError, "segment '", name, "': cannot map ", bytesText(off.total), ": ", e.what());
  }
  return m;
}

void checkJobId(const std::string& jobId, const std::string& name) {
  DISTILL_CHECK_T(IpcError, !jobId.empty() && jobId.size() < size_t(wire::kJobIdBytes), "segment '", name,
                  "': job id '", jobId, "' must have 1..", wire::kJobIdBytes - 1, " characters");
}

// Initialises a freshly created segment and publishes it (its magic, last).
std::shared_ptr<SegmentImpl> initialise(const std::string& name, std::shared_ptr<Mapping> mapping,
                                        const SegmentLayout& layout, const std::string& jobId, int creatorPid) {
  const LayoutOffsets off = computeOffsets(layout);
  auto impl = makeImpl(name, std::move(mapping), layout);
  auto* c = new (impl->base) wire::ControlBlock; // atomics: trivially default-constructed, memory is zero
  initControl(c, layout, jobId, off, creatorPid);
  for (int i = 0; i < impl->numProcesses(); ++i) {
    auto& e = impl->process(i);
    new (&e) wire::ProcessEntry;
    e.rank.store(-1, std::memory_order_relaxed);
    e.role.store(impl->isTeacher(i) ? 1 : 0, std::memory_order_relaxed);
  }
  // Publish: everything above happens-before an attacher's acquire load of magic.
  c->magic.store(wire::kSegmentMagic, std::memory_order_release);
  return impl;
}

} // namespace

Segment Segment::create(const std::string& name, const SegmentLayout& layout, const std::string& jobId) {
  checkLayout(layout, name);
  checkJobId(jobId, name);
  clearStaleSegment(name);
  const LayoutOffsets off = computeOffsets(layout);
  return Segment(initialise(name, createMapping(name, off, layout), layout, jobId, ::getpid()));
}

Segment Segment::createOrAttach(const std::string& name, const SegmentLayout& layout, const std::string& jobId,
                                int creatorPid, Deadline deadline) {
  checkLayout(layout, name);
  checkJobId(jobId, name);
  const LayoutOffsets off = computeOffsets(layout);
  auto m = createMapping(name, off, layout, /*mayExist=*/true);
  if (!m) return attach(name, jobId, layout, deadline); // another local process was first
  return Segment(initialise(name, std::move(m), layout, jobId, creatorPid));
}

Segment Segment::attach(const std::string& name, const std::string& jobId, const std::optional<SegmentLayout>& expected,
                        Deadline deadline) {
  const auto start = Clock::now();
  std::shared_ptr<Mapping> m;
  // The segment may not exist yet (the launcher creates it before spawning, but
  // a rank may be started by hand): back off from 1 to 50 ms until the deadline.
  for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(50))) {
    m = openExisting(name);
    if (m) {
      auto& c = *static_cast<const wire::ControlBlock*>(m->region.get_address());
      if (c.magic.load(std::memory_order_acquire) == wire::kSegmentMagic) break;
      if (c.magic.load(std::memory_order_relaxed) != 0)
        DISTILL_THROW(IpcError, "segment '", name, "': bad magic 0x", std::hex, c.magic.load(), " (expected 0x",
                      wire::kSegmentMagic, "): not a distill segment");
    }
    if (deadline.expired())
      DISTILL_THROW(TimeoutError, awaiting("segment '" + name + "'"), "segment '", name,
                    m ? "' was not initialised" : "' did not appear", " after ", toMs(Clock::now() - start), " ms");
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline.remaining()));
  }
  auto& c = *static_cast<const wire::ControlBlock*>(m->region.get_address());
  DISTILL_CHECK_T(IpcError, c.layoutVersion == wire::kLayoutVersion, "segment '", name, "' has layout version ",
                  c.layoutVersion, " but this build expects layout version ", wire::kLayoutVersion,
                  " (mixed distill builds on one node?)");
  DISTILL_CHECK_T(IpcError, c.controlChecksum == wire::controlChecksum(c), "segment '", name,
                  "': control block checksum mismatch (corrupted segment)");
  const std::string theirJob(c.jobId, strnlen(c.jobId, sizeof c.jobId));
  DISTILL_CHECK_T(IpcError, theirJob == jobId, "segment '", name, "' belongs to job '", theirJob,
                  "', not to this job '", jobId, "'");
  SegmentLayout l{c.numStudents, c.slots, c.maxRequestBytes, c.maxResponseBytes, c.heartbeatMs, c.numTeachers,
                    c.stallTimeoutMs};
  checkLayout(l, name);
  if (expected)
    DISTILL_CHECK_T(IpcError, l.matches(*expected), "segment '", name, "' has layout {", l.describe(),
                    "} but this process expects {", expected->describe(), "}");
  const LayoutOffsets off = computeOffsets(l);
  DISTILL_CHECK_T(IpcError,
                  c.totalBytes == off.total && c.processTableOffset == off.processTable &&
                      c.recorderOffset == off.recorder && c.ringsOffset == off.rings &&
                      c.requestSlotStride == off.requestSlotStride && c.responseSlotStride == off.responseSlotStride &&
                      c.ringPairStride == off.ringPairStride && c.configOffset == off.config &&
                      c.configBytesPerProcess == wire::kConfigBytesPerProcess && c.statusOffset == off.status,
                  "segment '", name, "': offsets in the control block do not match its layout {", l.describe(), "}");
  DISTILL_CHECK_T(IpcError, m->region.get_size() >= off.total, "segment '", name, "' is ", m->region.get_size(),
                  " bytes, its layout needs ", off.total);
  return Segment(makeImpl(name, std::move(m), l));
}

bool Segment::remove(const std::string& name) {
  removeHeadObjects(name); // the teacher's head lives and dies with its segment
  return bip::shared_memory_object::remove(name.c_str());
}

bool Segment::exists(const std::string& name) {
  try {
    bip::shared_memory_object shm(bip::open_only, name.c_str(), bip::read_only);
    return true;
  } catch (const bip::interprocess_exception&) {
    return false;
  }
}

const std::string& Segment::name() const { return impl_->name; }
SegmentLayout Segment::layout() const { return impl_->layout; }
std::string Segment::jobId() const {
  const auto& c = impl_->control();
  return std::string(c.jobId, strnlen(c.jobId, sizeof c.jobId));
}
uint64_t Segment::incarnation() const { return impl_->control().incarnation; }
int Segment::creatorPid() const { return impl_->control().creatorPid; }
size_t Segment::sizeBytes() const { return impl_->size; }
bool Segment::admitted() const {
  for (int t = 0; t < impl_->numTeachers(); ++t)
    if (impl_->control().teachers[t].admitted.load(std::memory_order_acquire) == 0) return false;
  return true;
}
int Segment::numTeachers() const { return impl_->numTeachers(); }

void Segment::abort() const {
  impl_->control().abort.store(1, std::memory_order_release);
  impl_->notifyAll();
}
bool Segment::aborted() const { return impl_->control().abort.load(std::memory_order_acquire) != 0; }
void Segment::requestStop() const { impl_->control().stopRequested.store(1, std::memory_order_release); }
bool Segment::stopRequested() const { return impl_->control().stopRequested.load(std::memory_order_acquire) != 0; }

} // namespace distill::ipc
