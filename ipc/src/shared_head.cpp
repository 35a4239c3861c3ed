// The teacher's head object (shared_head.h): publish by temporary + rename,
// read-only mapping validated before use. Paths under /dev/shm directly (not
// shm_open) because the flip is a rename(2) there, as removeStale lists it.
#include "distill/ipc/shared_head.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/sha256.h"
#include "sys.h"
#include "wire.h"

namespace distill::ipc {

struct SharedHead::Mapping {
  std::string name; // object name in /dev/shm
  void* base = MAP_FAILED;
  uint64_t bytes = 0; // mapped (the file's size)
  dev_t dev = 0; // identity of the mapped object, for replaced()
  ino_t ino = 0;
  std::string fingerprint;
  const wire::HeadHeader& header() const { return *static_cast<const wire::HeadHeader*>(base); }
  const uint8_t* at(uint64_t off) const { return static_cast<const uint8_t*>(base) + off; }
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }
};

namespace {

std::string shmPath(const std::string& name) { return "/dev/shm/" + name; }

// SHA-256 over the head's description and bytes (the contract in shared_head.h).
void fingerprintBytes(HeadDType dtype, int64_t vocab, int64_t dim, double softcap, double scale, const void* weight,
                      const void* bias, uint8_t out[wire::kFingerprintBytes]) {
  Sha256 h;
  const char tag[] = "distill-teacher-head-1";
  const uint32_t d = uint32_t(dtype), hasBias = bias != nullptr;
  const int64_t item = headItemSize(dtype);
  h.add(tag, sizeof tag);
  h.add(&d, sizeof d);
  h.add(&vocab, sizeof vocab);
  h.add(&dim, sizeof dim);
  h.add(&hasBias, sizeof hasBias);
  h.add(&softcap, sizeof softcap);
  h.add(&scale, sizeof scale);
  h.add(weight, size_t(vocab * dim * item));
  if (bias) h.add(bias, size_t(vocab * item));
  const Sha256::Digest digest = h.finish();
  static_assert(sizeof digest == wire::kFingerprintBytes, "the head fingerprint is a SHA-256");
  std::memcpy(out, digest.data(), digest.size());
}

void checkHeadBytes(const HeadBytes& h) {
  DISTILL_CHECK_T(UsageError,
                  h.dtype == HeadDType::kFloat32 || h.dtype == HeadDType::kFloat16 || h.dtype == HeadDType::kBFloat16,
                  "teacher head: dtype ", uint32_t(h.dtype), " is not float32, float16 or bfloat16");
  DISTILL_CHECK_T(UsageError, h.vocab >= 1 && h.dim >= 1 && h.vocab <= (int64_t(1) << 31) && h.dim <= (1 << 20),
                  "teacher head: weight shape [", h.vocab, ", ", h.dim, "] must be [1..2^31, 1..2^20]");
  DISTILL_CHECK_T(UsageError, h.weight != nullptr, "teacher head: no weight bytes");
  DISTILL_CHECK_T(UsageError, std::isfinite(h.softcap) && h.softcap >= 0, "teacher head: softcap ", h.softcap,
                  " must be finite and >= 0");
  DISTILL_CHECK_T(UsageError, std::isfinite(h.scale) && h.scale > 0, "teacher head: scale ", h.scale,
                  " must be finite and > 0");
}

// Fills the header of `h` with its offsets and sizes (no checksum, not complete).
void describe(const HeadBytes& h, uint64_t generation, wire::HeadHeader& hd) {
  hd.magic = wire::kHeadMagic;
  hd.layoutVersion = wire::kHeadLayoutVersion;
  hd.generation = generation;
  hd.dtype = uint32_t(h.dtype);
  hd.hasBias = h.bias != nullptr;
  hd.vocab = h.vocab;
  hd.dim = h.dim;
  hd.softcap = h.softcap;
  hd.scale = h.scale;
  const uint64_t item = uint64_t(headItemSize(h.dtype));
  hd.weightOffset = wire::kHeadHeaderBytes;
  hd.weightBytes = uint64_t(h.vocab) * uint64_t(h.dim) * item;
  hd.biasOffset = h.bias ? wire::alignUp(hd.weightOffset + hd.weightBytes, wire::kPayloadAlign) : 0;
  hd.biasBytes = h.bias ? uint64_t(h.vocab) * item : 0;
  hd.totalBytes = h.bias ? hd.biasOffset + hd.biasBytes : hd.weightOffset + hd.weightBytes;
  hd.publisherPid = int32_t(::getpid());
}

// Opens, checks and maps the object `name` read-only. nullptr when it does not
// exist; IpcError (naming `who`) when it is not a whole head.
std::shared_ptr<SharedHead::Mapping> mapObject(const std::string& name, const std::string& who) {
  Fd fd(sys::retryEintr([&] { return ::open(shmPath(name).c_str(), O_RDONLY | O_CLOEXEC); }));
  if (!fd) {
    if (errno == ENOENT) return nullptr;
    DISTILL_THROW(IpcError, who, ": cannot open the teacher's head '", shmPath(name), "': ", errnoString(errno));
  }
  struct stat st {};
  DISTILL_CHECK_T(IpcError, ::fstat(fd.get(), &st) == 0, who, ": cannot stat the teacher's head '", shmPath(name),
                  "': ", errnoString(errno));
  DISTILL_CHECK_T(IpcError, uint64_t(st.st_size) >= wire::kHeadHeaderBytes, who, ": the teacher's head '",
                  shmPath(name), "' is truncated: ", st.st_size, " bytes, less than its ", wire::kHeadHeaderBytes,
                  "-byte header");
  auto m = std::make_shared<SharedHead::Mapping>();
  m->name = name;
  m->bytes = uint64_t(st.st_size);
  m->dev = st.st_dev;
  m->ino = st.st_ino;
  m->base = ::mmap(nullptr, m->bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
  DISTILL_CHECK_T(IpcError, m->base != MAP_FAILED, who, ": cannot map the teacher's head '", shmPath(name), "' (",
                  m->bytes, " bytes): ", errnoString(errno));
  std::string why;
  DISTILL_CHECK_T(IpcError, wire::validateHeadHeader(m->header(), m->bytes, &why), who, ": the teacher's head '",
                  shmPath(name), "' is not a valid head object: ", why);
  m->fingerprint = hexBytes(m->header().fingerprint, wire::kFingerprintBytes);
  return m;
}

// The generation of the head published now, 0 if none (or not a valid one).
uint64_t currentGeneration(const std::string& name) {
  try {
    auto m = mapObject(name, "teacher");
    return m ? m->header().generation : 0;
  } catch (const IpcError& e) {
    DISTILL_LOG(kWarning) << "replacing an invalid teacher head: " << e.what();
    return 0;
  }
}

} // namespace

int64_t headItemSize(HeadDType d) { return wire::itemSize(static_cast<wire::DType>(d)); }
const char* headDTypeName(HeadDType d) { return wire::dtypeName(uint32_t(d)); }
std::string headObjectName(const std::string& segmentName) { return segmentName + ".head"; }

std::string headFingerprint(const HeadBytes& head) {
  checkHeadBytes(head);
  uint8_t fp[wire::kFingerprintBytes];
  fingerprintBytes(head.dtype, head.vocab, head.dim, head.softcap, head.scale, head.weight, head.bias, fp);
  return hexBytes(fp, sizeof fp);
}

SharedHead SharedHead::publish(const std::string& segmentName, const HeadBytes& head) {
  checkHeadBytes(head);
  static std::atomic<int> counter{0};
  const std::string name = headObjectName(segmentName);
  const std::string tmp = detail::str(name, ".tmp-", ::getpid(), "-", counter.fetch_add(1));
  const uint64_t generation = currentGeneration(name) + 1;
  wire::HeadHeader hd{};
  describe(head, generation, hd);
  auto [fd, p] = sys::createShmObject(tmp, hd.totalBytes, "teacher head");
  auto* h = new (p) wire::HeadHeader{}; // the object is zero-filled; placement for the atomic
  describe(head, generation, *h);
  auto* base = static_cast<uint8_t*>(p);
  std::memcpy(base + hd.weightOffset, head.weight, hd.weightBytes);
  if (head.bias) std::memcpy(base + hd.biasOffset, head.bias, hd.biasBytes);
  // The fingerprint of the bytes as they lie in the object, what readers verify.
  fingerprintBytes(head.dtype, head.vocab, head.dim, head.softcap, head.scale, base + hd.weightOffset,
                   head.bias ? base + hd.biasOffset : nullptr, h->fingerprint);
  h->checksum = wire::headHeaderChecksum(*h);
  h->complete.store(1, std::memory_order_release);
  ::munmap(p, hd.totalBytes);
  // Read-only from now on; then the flip: readers see the old object or this one, whole.
  int err = ::fchmod(fd.get(), 0400) == 0 ? 0 : errno;
  if (err == 0 && ::rename(shmPath(tmp).c_str(), shmPath(name).c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(shmPath(tmp).c_str());
    DISTILL_THROW(IpcError, "teacher head: cannot publish '", shmPath(tmp), "' as '", shmPath(name),
                  "': ", errnoString(err));
  }
  auto m = mapObject(name, "teacher pid " + std::to_string(::getpid()));
  DISTILL_CHECK_T(IpcError, m != nullptr, "teacher head '", shmPath(name), "' vanished right after publishing it");
  return SharedHead(std::move(m));
}

SharedHead SharedHead::open(const std::string& segmentName, const HeadReader& reader, Deadline deadline,
                            uint64_t afterGeneration) {
  const std::string who = detail::str(reader.role, " rank ", reader.rank);
  const std::string name = headObjectName(segmentName);
  const auto start = Clock::now();
  uint64_t seen = 0;
  // Published once per teacher start: back off from 1 to 50 ms until the deadline, as Segment::attach.
  for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(50))) {
    if (auto m = mapObject(name, who)) {
      seen = m->header().generation;
      if (seen > afterGeneration) return SharedHead(std::move(m));
    }
    if (deadline.expired()) {
      const std::string what = afterGeneration ? detail::str("a teacher head newer than generation ", afterGeneration)
                                               : std::string("the teacher's head");
      DISTILL_THROW(TimeoutError, awaiting(what + " '" + shmPath(name) + "'"), who, " waited for ", what, " '",
                    shmPath(name), "' for ", toMs(Clock::now() - start), " ms: ",
                    seen ? detail::str("generation ", seen, " is still the one published")
                         : std::string("none was published"));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline.remaining()));
  }
}

bool SharedHead::replaced() const {
  struct stat st {};
  if (::stat(shmPath(m_->name).c_str(), &st) != 0) return true;
  return st.st_dev != m_->dev || st.st_ino != m_->ino;
}

const std::string& SharedHead::objectName() const { return m_->name; }
uint64_t SharedHead::generation() const { return m_->header().generation; }
const std::string& SharedHead::fingerprint() const { return m_->fingerprint; }
int SharedHead::publisherPid() const { return m_->header().publisherPid; }
HeadDType SharedHead::dtype() const { return HeadDType(m_->header().dtype); }
int64_t SharedHead::vocab() const { return m_->header().vocab; }
int64_t SharedHead::dim() const { return m_->header().dim; }
bool SharedHead::hasBias() const { return m_->header().hasBias != 0; }
double SharedHead::softcap() const { return m_->header().softcap; }
double SharedHead::scale() const { return m_->header().scale; }
const void* SharedHead::weight() const { return m_->at(m_->header().weightOffset); }
const void* SharedHead::bias() const { return hasBias() ? m_->at(m_->header().biasOffset) : nullptr; }
uint64_t SharedHead::objectBytes() const { return m_->header().totalBytes; }
std::shared_ptr<const void> SharedHead::keepAlive() const { return m_; }

void SharedHead::verify() const {
  uint8_t fp[wire::kFingerprintBytes];
  fingerprintBytes(dtype(), vocab(), dim(), softcap(), scale(), weight(), bias(), fp);
  const std::string now = hexBytes(fp, sizeof fp);
  DISTILL_CHECK_T(IpcError, now == m_->fingerprint, "teacher head '", shmPath(m_->name), "': its bytes hash to ", now,
                  " but its header says ", m_->fingerprint, " (corrupted)");
}

int removeHeadObjects(const std::string& segmentName) {
  const std::string name = headObjectName(segmentName), tmpPrefix = name + ".";
  std::vector<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n == name || n.compare(0, tmpPrefix.size(), tmpPrefix) == 0) names.push_back(n);
    }
    ::closedir(d);
  }
  int removed = 0;
  for (auto& n : names) removed += ::unlink(shmPath(n).c_str()) == 0;
  return removed;
}

std::vector<std::string> removeOrphanHeads(const std::string& prefix) {
  std::vector<std::string> orphans;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      const size_t at = n.find(".head");
      if (n.compare(0, prefix.size(), prefix) != 0 || at == std::string::npos) continue;
      struct stat st {};
      if (::stat(shmPath(n.substr(0, at)).c_str(), &st) != 0 && errno == ENOENT) orphans.push_back(n);
    }
    ::closedir(d);
  }
  std::vector<std::string> removed;
  for (auto& n : orphans)
    if (::unlink(shmPath(n).c_str()) == 0) removed.push_back(n);
  return removed;
}

} // namespace distill::ipc
