// The teacher-output cache's LMDB store (cache.h): opening it (ownership, format, a
// damaged or truncated store), reading a record (bounds, CRC32C), inserting a
// batch of records in one transaction, and the counts of what it holds.
#include "cache.h"

#include <lmdb.h>

#include <pwd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/answer_kinds.h"
#include "distill/core/strings.h"
#include "distill/core/sys.h"
#include "files.h"

namespace distill {
namespace {

// The header record: its key is no 32-byte digest, so no row key meets it.
const std::string kHeaderKey = "distill-teacher-cache";
std::string headerValue(uint32_t version) { return "format " + std::to_string(version); }
// The signal record: the answer context of the teacher that wrote the store
// (keys.h: its weights, the answer kind and its parameters, the payload
// dtype...). A store holds one teacher's one signal; a teacher of another
// context is refused at open, naming what differs, instead of missing every row.
const std::string kSignalKey = "distill-teacher-signal";

std::vector<std::string> contextLines(const std::string& context) {
  std::vector<std::string> out;
  std::istringstream in(context);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// "it holds X where this teacher answers Y" over the lines that differ (by position).
std::string signalDifference(const std::string& stored, const std::string& mine) {
  const std::vector<std::string> a = contextLines(stored), b = contextLines(mine);
  std::string held, wanted;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "(nothing)", y = i < b.size() ? b[i] : "(nothing)";
    if (x == y) continue;
    held += (held.empty() ? "" : "; ") + x;
    wanted += (wanted.empty() ? "" : "; ") + y;
  }
  return "it holds answers of [" + held + "] where this teacher answers [" + wanted + "]";
}

std::string lmdbError(int rc) { return mdb_strerror(rc); }

// Why a write of `bytes` into the store at `path` failed. LMDB reports a short
// write to a full disk as EIO (mdb_page_flush), so a file system without room
// for the write is said as such, with the bytes it has free.
std::string writeFailure(const std::string& path, const std::string& what, int rc, int64_t bytes) {
  struct statvfs fs {};
  if ((rc == EIO || rc == ENOSPC) && ::statvfs(path.c_str(), &fs) == 0) {
    const uint64_t free = uint64_t(fs.f_bavail) * uint64_t(fs.f_frsize);
    if (rc == ENOSPC || free < uint64_t(bytes) + (uint64_t(1) << 20)) {
      return "cannot store rows: no space left on the file system of " + path + " (" + std::to_string(free) +
          " bytes free, a write of about " + std::to_string(bytes) + " bytes; " + what + ": " + lmdbError(rc) + ")";
    }
  }
  return "cannot store rows: " + what + ": " + lmdbError(rc);
}

// Damaged rows logged one by one; past this many they are only counted.
constexpr int64_t kCorruptLogged = 10;

// What LMDB spends on a row of `record` bytes (estimate): a node of header,
// key and value in a leaf page, or, past the node limit (about half a page),
// the value in whole overflow pages of their own.
int64_t storedCost(size_t record, int64_t pageSize) {
  const int64_t node = 8 + int64_t(sizeof(CacheKey)) + 2; // node header, key, its slot in the page
  const int64_t nodeMax = ((pageSize - 16) / 2 & ~int64_t(1)) - 2;
  if (node + int64_t(record) <= nodeMax) return node + int64_t(record);
  return node + 8 + (16 + int64_t(record) + pageSize - 1) / pageSize * pageSize;
}

// ---- the LMDB store ----

} // namespace

struct TeacherCache::Env {
  MDB_env* env = nullptr;
  MDB_dbi dbi = 0;
  int64_t pageSize = 4096;
  std::string file; // data.mdb
  const char* map = nullptr; // where data.mdb is mapped (findMap)
  ~Env() {
    if (env) mdb_env_close(env);
  }
  // Does `v` (a value of a read transaction: in the map) lie inside data.mdb?
  // A damaged node could give a size past the file's end, where a read would SIGBUS.
  bool inFile(const MDB_val& v) {
    int fd = -1;
    struct stat st {};
    if (mdb_env_get_fd(env, &fd) != 0 || ::fstat(fd, &st) != 0) return false;
    for (int attempt = 0; attempt < 2; ++attempt) {
      // Again once: the map moves when another teacher grows it.
      if (!map || attempt == 1) map = cache_files::findMap(file, fd);
      const auto* p = static_cast<const char*>(v.mv_data);
      const size_t size = size_t(st.st_size);
      if (map && p >= map && size_t(p - map) <= size && v.mv_size <= size - size_t(p - map)) return true;
    }
    return false;
  }
};

namespace {

// A transaction aborted unless committed.
class Txn {
 public:
  Txn(MDB_env* env, unsigned flags, const std::string& path) {
    int rc = mdb_txn_begin(env, nullptr, flags, &txn_);
    if (rc == MDB_MAP_RESIZED) { // another teacher grew the map: adopt its size
      mdb_env_set_mapsize(env, 0);
      rc = mdb_txn_begin(env, nullptr, flags, &txn_);
    }
    DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path, ": cannot begin a transaction: ", lmdbError(rc));
  }
  ~Txn() {
    if (txn_) mdb_txn_abort(txn_);
  }
  MDB_txn* get() const { return txn_; }
  int commit() {
    const int rc = mdb_txn_commit(txn_);
    txn_ = nullptr;
    return rc;
  }

 private:
  MDB_txn* txn_ = nullptr;
};

// mdb_txn_begin, adopting a map another teacher grew; 0 or LMDB's error.
int beginTxn(MDB_env* env, unsigned flags, MDB_txn** txn) {
  int rc = mdb_txn_begin(env, nullptr, flags, txn);
  if (rc == MDB_MAP_RESIZED) {
    mdb_env_set_mapsize(env, 0);
    rc = mdb_txn_begin(env, nullptr, flags, txn);
  }
  return rc;
}

MDB_val val(const void* p, size_t n) { return MDB_val{n, const_cast<void*>(p)}; }

} // namespace

TeacherCache::TeacherCache(const TeacherOptions::CacheOptions& o, std::string context, std::vector<std::string> names,
                           double temperature, Faults faults)
    : path_(o.path),
      context_(std::move(context)),
      names_(std::move(names)),
      temperature_(temperature),
      keys_(o.keys),
      dtype_(o.dtype),
      maxBytes_(o.max_bytes),
      reads_(o.mode == CacheMode::kRead || o.mode == CacheMode::kReadWrite),
      writes_(o.mode == CacheMode::kWrite || o.mode == CacheMode::kReadWrite),
      faults_(std::move(faults)) {
  // POSIX calls, no std::filesystem (core/sys.h says why).
  if (writes_) {
    cache_files::makeStoreDir(path_);
  } else {
    struct stat st {};
    DISTILL_CHECK_T(ConfigError, ::stat((path_ + "/data.mdb").c_str(), &st) == 0, "teacher.cache.path: ", path_,
                    " holds no cache (no data.mdb); teacher.cache.mode read needs a "
                    "store written by a run with mode write or readwrite");
  }
  cache_files::checkPrivate(path_, true);
  cache_files::checkPrivate(path_ + "/data.mdb", false);
  cache_files::checkPrivate(path_ + "/lock.mdb", false);
  open(o);
  readHeader();
}

// Opens the LMDB environment; a truncated or invalid store is an error, or set aside once (on_corrupt restart).
void TeacherCache::open(const TeacherOptions::CacheOptions& o) {
  for (int attempt = 0;; ++attempt) {
    env_ = std::make_unique<Env>();
    env_->file = path_ + "/data.mdb";
    int rc = mdb_env_create(&env_->env);
    DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": mdb_env_create: ", lmdbError(rc));
    rc = mdb_env_set_mapsize(env_->env, static_cast<size_t>(maxBytes_));
    DISTILL_CHECK_T(ConfigError, rc == 0, "teacher.cache.max_bytes=", maxBytes_, ": ", lmdbError(rc));
    // Metadata is flushed with the data once per commit (MDB_NOMETASYNC): a
    // killed process loses nothing committed; an OS crash may undo the last
    // commit, never corrupt the store. Files owner-only (0600).
    const unsigned flags = MDB_NOMETASYNC | (writes_ ? 0u : unsigned(MDB_RDONLY));
    // An empty data.mdb (a store whose first write never happened, a file
    // truncated to 0) is no store: LMDB fails on it with EBADF or EINVAL.
    struct stat fs {};
    const bool empty = ::stat(env_->file.c_str(), &fs) == 0 && S_ISREG(fs.st_mode) && fs.st_size == 0;
    rc = empty ? 0 : mdb_env_open(env_->env, path_.c_str(), flags, 0600);
    std::string bad;
    if (empty) {
      bad = "data.mdb is an empty store file (0 bytes)";
    } else if (rc == MDB_INVALID || rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND) {
      bad = "LMDB finds it invalid: " + lmdbError(rc);
    } else {
      DISTILL_CHECK_T(ConfigError, rc == 0, "teacher.cache.path: cannot open the LMDB store in ", path_, ": ",
                      lmdbError(rc));
      bad = checkOpened();
    }
    if (bad.empty()) break;
    const bool restart = o.on_corrupt == OnCorrupt::kRestart && writes_ && attempt == 0;
    DISTILL_CHECK_T(ConfigError, restart, "teacher.cache.path: the store in ", path_, " is damaged: ", bad,
                    o.on_corrupt == OnCorrupt::kRestart
                        ? "; teacher.cache.on_corrupt restart starts anew only in mode write or readwrite"
                        : "; remove it, or set teacher.cache.on_corrupt: restart to set it aside and start anew");
    DISTILL_LOG(kWarning) << "teacher cache " << path_ << " is damaged (" << bad << "): set aside, starting anew";
    setAside();
  }
  MDB_stat st;
  if (mdb_env_stat(env_->env, &st) == 0) env_->pageSize = st.ms_psize;
  int dead = 0;
  mdb_reader_check(env_->env, &dead); // reader slots of dead teachers
  if (dead > 0) {
    DISTILL_LOG(kInfo) << "teacher cache " << path_ << ": cleared " << dead << " stale reader slot(s)";
  }
}

// LMDB maps data.mdb up to its last page as the meta page says, and a page past
// the file's end is a SIGBUS at its first read: a truncated file is refused here.
std::string TeacherCache::checkOpened() {
  MDB_envinfo info;
  MDB_stat st;
  int fd = -1;
  struct stat fs {};
  if (mdb_env_info(env_->env, &info) != 0 || mdb_env_stat(env_->env, &st) != 0 || mdb_env_get_fd(env_->env, &fd) != 0 ||
      ::fstat(fd, &fs) != 0) {
    return "cannot read its size";
  }
  const uint64_t need = (uint64_t(info.me_last_pgno) + 1) * st.ms_psize;
  if (uint64_t(fs.st_size) >= need) return "";
  return "data.mdb holds " + std::to_string(fs.st_size) + " bytes, its meta page says " + std::to_string(need) +
      " (pages 0.." + std::to_string(info.me_last_pgno) + " of " + std::to_string(st.ms_psize) +
      " bytes): it was truncated";
}

// data.mdb renamed to data.mdb.corrupt-<UTC time>-<pid> beside it; the next open starts a new store.
void TeacherCache::setAside() {
  env_.reset();
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
  const std::string from = path_ + "/data.mdb";
  const std::string to = from + ".corrupt-" + stamp + "-" + std::to_string(::getpid());
  DISTILL_CHECK_T(ConfigError, ::rename(from.c_str(), to.c_str()) == 0, "teacher.cache.path: cannot set ", from,
                  " aside as ", to, ": ", errnoString(errno));
  DISTILL_LOG(kWarning) << "teacher cache " << path_ << ": the damaged store was moved to " << to;
}

void TeacherCache::readHeader() {
  Txn txn(env_->env, writes_ ? 0u : unsigned(MDB_RDONLY), path_);
  int rc = mdb_dbi_open(txn.get(), nullptr, 0, &env_->dbi);
  DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": mdb_dbi_open: ", lmdbError(rc));
  MDB_val key = val(kHeaderKey.data(), kHeaderKey.size()), data;
  const std::string want = headerValue(kCacheFormatVersion);
  bool dirty = false;
  rc = mdb_get(txn.get(), env_->dbi, &key, &data);
  if (rc == 0) {
    DISTILL_CHECK_T(ConfigError, env_->inFile(data) && data.mv_size < 64, "teacher.cache.path: the store in ", path_,
                    " is damaged: its header record lies outside data.mdb");
    const std::string found(static_cast<const char*>(data.mv_data), data.mv_size);
    DISTILL_CHECK_T(ConfigError, found == want, "teacher.cache.path: the store in ", path_, " has cache ", found,
                    ", this teacher reads and writes ", want, "; give another path or remove the store");
  } else {
    DISTILL_CHECK_T(ConfigError, rc == MDB_NOTFOUND, "teacher.cache.path: the store in ", path_,
                    " is damaged: its header cannot be read: ", lmdbError(rc));
    DISTILL_CHECK_T(ConfigError, writes_, "teacher.cache.path: ", path_, " holds no distill teacher cache");
    MDB_val v = val(want.data(), want.size());
    rc = mdb_put(txn.get(), env_->dbi, &key, &v, 0);
    DISTILL_CHECK_T(ConfigError, rc == 0, "teacher cache ", path_, ": cannot write its header: ", lmdbError(rc));
    dirty = true;
  }
  dirty = checkSignal(txn.get()) || dirty;
  if (!dirty) return;
  rc = txn.commit();
  DISTILL_CHECK_T(ConfigError, rc == 0, "teacher cache ", path_, ": cannot write its header: ", lmdbError(rc));
}

// The store's signal record against this teacher's answer context: another is
// refused naming what differs; none (a new store, or one of 0.4) gets this
// teacher's when it writes. True when it put the record.
bool TeacherCache::checkSignal(MDB_txn* txn) {
  MDB_val key = val(kSignalKey.data(), kSignalKey.size()), data;
  int rc = mdb_get(txn, env_->dbi, &key, &data);
  if (rc == 0) {
    DISTILL_CHECK_T(ConfigError, env_->inFile(data), "teacher.cache.path: the store in ", path_,
                    " is damaged: its signal record lies outside data.mdb");
    const std::string stored(static_cast<const char*>(data.mv_data), data.mv_size);
    DISTILL_CHECK_T(ConfigError, stored == context_, "teacher.cache.path: the store in ", path_,
                    " was written by another teacher or for another signal: ", signalDifference(stored, context_),
                    ". A store holds one teacher's answers of one kind: give this teacher another "
                    "teacher.cache.path, or remove the store");
    return false;
  }
  DISTILL_CHECK_T(ConfigError, rc == MDB_NOTFOUND, "teacher.cache.path: the store in ", path_,
                  " is damaged: its signal record cannot be read: ", lmdbError(rc));
  if (!writes_) return false;
  MDB_val v = val(context_.data(), context_.size());
  rc = mdb_put(txn, env_->dbi, &key, &v, 0);
  DISTILL_CHECK_T(ConfigError, rc == 0, "teacher cache ", path_, ": cannot write its signal record: ", lmdbError(rc));
  return true;
}

TeacherCache::~TeacherCache() = default;

// A row's record, or nullopt: not stored, or damaged (counted, logged, never served).
std::optional<std::string> TeacherCache::lookup(const CacheKey& k) {
  if (!readable_) return std::nullopt;
  MDB_txn* txn = nullptr;
  int rc = beginTxn(env_->env, MDB_RDONLY, &txn);
  if (rc != 0) { // MDB_PANIC after a failed write: nothing can be read any more
    readable_ = false;
    DISTILL_LOG(kWarning) << "teacher cache " << path_ << " can no longer be read (" << lmdbError(rc)
                          << "): every row is computed from now on";
    return std::nullopt;
  }
  MDB_val key = val(k.data(), k.size()), data;
  rc = mdb_get(txn, env_->dbi, &key, &data);
  std::optional<std::string> out;
  if (rc == 0) {
    if (!env_->inFile(data)) {
      noteCorrupt(k, "its record lies outside data.mdb");
    } else if (!recordIntact(k, data.mv_data, data.mv_size)) {
      noteCorrupt(k, "its record fails its CRC32C");
      damaged_.insert(k);
    } else {
      out.emplace(static_cast<const char*>(data.mv_data), data.mv_size);
    }
  } else if (rc != MDB_NOTFOUND) {
    noteCorrupt(k, lmdbError(rc)); // a damaged page on the way to it
  }
  mdb_txn_abort(txn);
  return out;
}

void TeacherCache::noteCorrupt(const CacheKey& k, const std::string& why) {
  ++stats_.corrupt;
  if (stats_.corrupt <= kCorruptLogged) {
    // teacher.cache.keys prefix: every record is one position of a row.
    DISTILL_LOG(kWarning) << "teacher cache " << path_ << ": the " << (keys_ == CacheKeys::kPrefix ? "position" : "row")
                          << " with key " << keyHex(k) << " is damaged (" << why
                          << "); it is computed instead, never served from the store"
                          << (stats_.corrupt == kCorruptLogged ? " (further damaged rows are only counted)" : "");
  }
}

// Inserts stop for good, said once; lookups go on, and the job with them.
void TeacherCache::stopInserting(const std::string& why) {
  if (full_) return;
  full_ = true;
  maxBytesReached_ = why.rfind("is full", 0) == 0;
  stopReason_ = why;
  DISTILL_LOG(kWarning) << "teacher cache " << path_ << " " << why
                        << ": no more rows are stored; rows already stored are still served";
}

void TeacherCache::insert(const std::vector<std::pair<CacheKey, std::string>>& rows,
                          const std::vector<int64_t>& tokens) {
  if (rows.empty() || full_) return;
  const std::string fullText = "is full (teacher.cache.max_bytes=" + std::to_string(maxBytes_) + ")";
  MDB_txn* txn = nullptr;
  int rc = beginTxn(env_->env, 0, &txn);
  if (rc != 0) return stopInserting("cannot store rows: cannot begin a write transaction: " + lmdbError(rc));
  int64_t added = 0, addedTokens = 0, addedBytes = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& [k, record] = rows[i];
    MDB_val key = val(k.data(), k.size()), data = val(record.data(), record.size());
    // An entry another teacher wrote first stays (its bytes are what it
    // answered), unless this process found it damaged.
    rc = mdb_put(txn, env_->dbi, &key, &data, damaged_.count(k) ? 0u : unsigned(MDB_NOOVERWRITE));
    if (rc == MDB_KEYEXIST) continue;
    if (rc != 0) {
      // The batch's transaction is dropped whole; what was committed before stays and is served.
      mdb_txn_abort(txn);
      return stopInserting(rc == MDB_MAP_FULL ? fullText : writeFailure(path_, "a write failed", rc, addedBytes));
    }
    ++added;
    addedTokens += tokens[i];
    addedBytes += storedCost(record.size(), env_->pageSize);
  }
  ++commits_;
  rc = faults_.commit ? faults_.commit(commits_) : 0;
  if (rc != 0) {
    mdb_txn_abort(txn);
  } else {
    rc = mdb_txn_commit(txn);
  }
  if (rc != 0) {
    return stopInserting(rc == MDB_MAP_FULL ? fullText : writeFailure(path_, "commit failed", rc, addedBytes));
  }
  for (const auto& row : rows) damaged_.erase(row.first);
  stats_.inserted += added;
  stats_.insertedTokens += addedTokens;
  stats_.storedBytes += addedBytes;
}

std::string TeacherCache::summary() const {
  const CacheStats& c = stats_;
  std::ostringstream os;
  os << "teacher cache " << path_ << ": " << c.rows << " rows (" << c.tokens << " tokens), " << c.lookups
     << " looked up, " << c.hits << " hits (" << (c.lookups > 0 ? 100.0 * double(c.hits) / double(c.lookups) : 0.0)
     << "% of the rows looked up, " << c.hitTokens << " tokens), " << c.corrupt << " damaged, " << c.forwards
     << " forwards, " << c.inserted << " rows stored (" << c.insertedTokens << " tokens), store " << storeBytes()
     << " bytes";
  if (c.insertedTokens > 0) os << " (" << std::lround(bytesPerStoredToken()) << " bytes per stored token)";
  if (keys_ == CacheKeys::kPrefix) {
    os << "; prefix keys: " << c.positions << " positions, " << c.positionHits << " hits, " << c.positionsComputed
       << " computed";
  }
  if (full_) os << "; " << stopReason_ << ": stored no more rows";
  return os.str();
}

double TeacherCache::bytesPerStoredToken() const {
  return stats_.insertedTokens > 0 ? double(stats_.storedBytes) / double(stats_.insertedTokens) : 0.0;
}

int64_t TeacherCache::storeBytes() const {
  MDB_envinfo info;
  MDB_stat st;
  if (mdb_env_info(env_->env, &info) != 0 || mdb_env_stat(env_->env, &st) != 0) return -1;
  return static_cast<int64_t>(info.me_last_pgno + 1) * st.ms_psize;
}

} // namespace distill
