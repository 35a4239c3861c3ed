#include "cache.h"

#include <lmdb.h>

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/protocol.h"
#include "distill/core/strings.h"
#include "distill/core/sys.h"

namespace distill {
namespace {

// The header record: its key is no 32-byte digest, so no row key meets it.
const std::string kHeaderKey = "distill-teacher-cache";
std::string headerValue(uint32_t version) { return "format " + std::to_string(version); }

std::string lmdbError(int rc) { return mdb_strerror(rc); }

} // namespace

// ---- the LMDB store ----

struct TeacherCache::Env {
  MDB_env* env = nullptr;
  MDB_dbi dbi = 0;
  ~Env() {
    if (env) mdb_env_close(env);
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

MDB_val val(const void* p, size_t n) { return MDB_val{n, const_cast<void*>(p)}; }

} // namespace

TeacherCache::TeacherCache(const TeacherOptions::CacheOptions& o, std::string context, std::vector<std::string> names,
                           double temperature)
    : env_(std::make_unique<Env>()),
      path_(o.path),
      context_(std::move(context)),
      names_(std::move(names)),
      temperature_(temperature),
      maxBytes_(o.max_bytes),
      reads_(o.mode == CacheMode::kRead || o.mode == CacheMode::kReadWrite),
      writes_(o.mode == CacheMode::kWrite || o.mode == CacheMode::kReadWrite) {
  // POSIX calls, no std::filesystem (core/sys.h says why).
  if (writes_) {
    std::string failedAt;
    const int err = makeDirs(path_, &failedAt);
    DISTILL_CHECK_T(ConfigError, err == 0, "teacher.cache.path: cannot create the directory ", failedAt, ": ",
                    errnoString(err));
  } else {
    struct stat st {};
    DISTILL_CHECK_T(ConfigError, ::stat((path_ + "/data.mdb").c_str(), &st) == 0, "teacher.cache.path: ", path_,
                    " holds no cache (no data.mdb); teacher.cache.mode read needs a "
                    "store written by a run with mode write or readwrite");
  }
  int rc = mdb_env_create(&env_->env);
  DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": mdb_env_create: ", lmdbError(rc));
  rc = mdb_env_set_mapsize(env_->env, static_cast<size_t>(maxBytes_));
  DISTILL_CHECK_T(ConfigError, rc == 0, "teacher.cache.max_bytes=", maxBytes_, ": ", lmdbError(rc));
  // Metadata is flushed with the data once per commit (MDB_NOMETASYNC): a
  // killed process loses nothing committed; an OS crash may undo the last
  // commit, never corrupt the store.
  const unsigned flags = MDB_NOMETASYNC | (writes_ ? 0u : unsigned(MDB_RDONLY));
  rc = mdb_env_open(env_->env, path_.c_str(), flags, 0644);
  DISTILL_CHECK_T(ConfigError, rc == 0, "teacher.cache.path: cannot open the LMDB store in ", path_, ": ",
                  lmdbError(rc));
  int dead = 0;
  mdb_reader_check(env_->env, &dead); // reader slots of dead teachers
  if (dead > 0) {
    DISTILL_LOG(kInfo) << "teacher cache " << path_ << ": cleared " << dead << " stale reader slot(s)";
  }

  Txn txn(env_->env, writes_ ? 0u : unsigned(MDB_RDONLY), path_);
  rc = mdb_dbi_open(txn.get(), nullptr, 0, &env_->dbi);
  DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": mdb_dbi_open: ", lmdbError(rc));
  MDB_val key = val(kHeaderKey.data(), kHeaderKey.size()), data;
  const std::string want = headerValue(kCacheFormatVersion);
  rc = mdb_get(txn.get(), env_->dbi, &key, &data);
  if (rc == 0) {
    const std::string found(static_cast<const char*>(data.mv_data), data.mv_size);
    DISTILL_CHECK_T(ConfigError, found == want, "teacher.cache.path: the store in ", path_, " has cache ", found,
                    ", this teacher reads and writes ", want, "; give another path or remove the store");
  } else {
    DISTILL_CHECK_T(IpcError, rc == MDB_NOTFOUND, "teacher cache ", path_, ": ", lmdbError(rc));
    DISTILL_CHECK_T(ConfigError, writes_, "teacher.cache.path: ", path_, " holds no distill teacher cache");
    MDB_val v = val(want.data(), want.size());
    rc = mdb_put(txn.get(), env_->dbi, &key, &v, 0);
    DISTILL_CHECK_T(ConfigError, rc == 0, "teacher cache ", path_, ": cannot write its header: ", lmdbError(rc));
    rc = txn.commit();
    DISTILL_CHECK_T(ConfigError, rc == 0, "teacher cache ", path_, ": cannot write its header: ", lmdbError(rc));
  }
}

TeacherCache::~TeacherCache() = default;

std::optional<std::string> TeacherCache::lookup(const CacheKey& k) {
  Txn txn(env_->env, MDB_RDONLY, path_);
  MDB_val key = val(k.data(), k.size()), data;
  const int rc = mdb_get(txn.get(), env_->dbi, &key, &data);
  if (rc == MDB_NOTFOUND) return std::nullopt;
  DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": lookup failed: ", lmdbError(rc));
  return std::string(static_cast<const char*>(data.mv_data), data.mv_size);
}

void TeacherCache::insert(const std::vector<std::pair<CacheKey, std::string>>& rows) {
  if (rows.empty() || full_) return;
  Txn txn(env_->env, 0, path_);
  int added = 0;
  for (const auto& [k, record] : rows) {
    MDB_val key = val(k.data(), k.size()), data = val(record.data(), record.size());
    // An entry another teacher wrote first stays: its bytes are what it answered.
    const int rc = mdb_put(txn.get(), env_->dbi, &key, &data, MDB_NOOVERWRITE);
    if (rc == MDB_KEYEXIST) continue;
    if (rc == MDB_MAP_FULL) {
      full_ = true;
      break;
    }
    DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": insert failed: ", lmdbError(rc));
    ++added;
  }
  if (!full_) {
    const int rc = txn.commit();
    if (rc == MDB_MAP_FULL) {
      full_ = true;
    } else {
      DISTILL_CHECK_T(IpcError, rc == 0, "teacher cache ", path_, ": commit failed: ", lmdbError(rc));
      stats_.inserted += added;
    }
  }
  if (full_) {
    // The batch's transaction is dropped whole; what was committed before stays and is served.
    DISTILL_LOG(kWarning) << "teacher cache " << path_ << " is full (teacher.cache.max_bytes=" << maxBytes_
                          << "): no more rows are stored; rows already stored are still served";
  }
}

int64_t TeacherCache::storeBytes() const {
  MDB_envinfo info;
  MDB_stat st;
  if (mdb_env_info(env_->env, &info) != 0 || mdb_env_stat(env_->env, &st) != 0) return -1;
  return static_cast<int64_t>(info.me_last_pgno + 1) * st.ms_psize;
}

std::vector<Answer> TeacherCache::answer(const std::vector<std::vector<at::Tensor>>& requests, const Compute& compute,
                                         const at::Device& device) {
  struct Row {
    size_t request;
    int64_t row;
    CacheKey key;
  };
  std::vector<std::vector<std::string>> records(requests.size());
  std::vector<Row> missing;
  for (size_t q = 0; q < requests.size(); ++q) {
    std::vector<at::Tensor> host;
    for (const at::Tensor& t : requests[q]) host.push_back(t.contiguous().cpu());
    const int64_t rows = host.at(0).size(0);
    const int64_t tokensPerRow = host[0].dim() >= 2 ? host[0].size(1) : 1;
    records[q].resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      CacheKey key = rowKey(context_, names_, host, r);
      ++stats_.rows;
      stats_.tokens += tokensPerRow;
      if (reads_) {
        if (auto record = lookup(key)) {
          records[q][size_t(r)] = std::move(*record);
          ++stats_.hits;
          stats_.hitTokens += tokensPerRow;
          continue;
        }
      }
      missing.push_back({q, r, key});
    }
  }
  if (!missing.empty()) {
    // Every missing row of every request in one forward: runs of consecutive
    // rows of one request are taken as one slice.
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < names_.size(); ++i) {
      std::vector<at::Tensor> parts;
      for (size_t m = 0; m < missing.size();) {
        size_t end = m + 1;
        while (end < missing.size() && missing[end].request == missing[m].request &&
               missing[end].row == missing[end - 1].row + 1) {
          ++end;
        }
        parts.push_back(requests[missing[m].request][i].narrow(0, missing[m].row, int64_t(end - m)));
        m = end;
      }
      inputs.push_back(parts.size() == 1 ? parts[0] : at::cat(parts, 0));
    }
    Computed computed = compute(inputs);
    ++stats_.forwards;
    roundForStorage(computed.answer, temperature_);
    std::vector<std::pair<CacheKey, std::string>> rows;
    Answer host;
    for (auto& [name, t] : computed.answer) host[name] = t.cpu();
    for (size_t m = 0; m < missing.size(); ++m) {
      Answer row;
      for (auto& [name, t] : host) row[name] = t.narrow(0, int64_t(m), 1);
      std::string record = encodeRow(row, computed.vocab);
      if (writes_) rows.emplace_back(missing[m].key, record);
      records[missing[m].request][size_t(missing[m].row)] = std::move(record);
    }
    if (writes_) insert(rows);
  }
  // Every row, hit or computed, is answered from its record's bytes.
  std::vector<Answer> out(requests.size());
  for (size_t q = 0; q < requests.size(); ++q) {
    std::map<std::string, std::vector<at::Tensor>> parts;
    for (const std::string& record : records[q]) {
      for (auto& [name, t] : decodeRow(record.data(), record.size())) parts[name].push_back(t);
    }
    for (auto& [name, list] : parts) out[q][name] = at::cat(list, 0).to(device);
  }
  return out;
}

} // namespace distill
