// teacher_cache_test: the store's integrity (teacher/src/cache/store.cpp,
// records.cpp; issue 27 items 4.1, 4.2, 4.7, 4.11): damaged records are misses
// never served, stores others can change or that are truncated or empty are
// refused, a failed commit or a full disk stops inserting.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <lmdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "cache/cache.h"
#include "cache_store_dir.h"
#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/student/losses.h"
#include "distill/teacher/server.h"
#include "support/roles.h"
#include "cache_test_util.h"

using distill::Answer;
using distill::CacheKey;
using distill::TeacherCache;
namespace dt = distill::testing;
using namespace cache_testing;

namespace {

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void writeAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A store's copy: a new owner-only folder holding `bytes` as data.mdb (0600).
struct StoreCopy : TempDir {
  explicit StoreCopy(const std::string& bytes) {
    EXPECT_EQ(::mkdir(path.c_str(), 0700), 0) << path;
    writeAll(path + "/data.mdb", bytes);
    ::chmod((path + "/data.mdb").c_str(), 0600);
  }
};

// The rows the integrity tests store: 40 rows of 16 tokens, full logits over 256 entries
// (8 KiB records, in LMDB's overflow pages) or the top-4 (small records, in leaf pages).
constexpr int64_t kIntegrityRows = 40;
at::Tensor integrityRows() { return ids(kIntegrityRows, 16, 2027); }
TeacherCache::Computed integrityAnswer(const at::Tensor& x, int64_t k) { return shaped(x, k, 256); }

// Writes the rows into a new store at `dir`; returns every row's answer as served.
std::vector<Answer> writeIntegrityStore(const std::string& dir, int64_t k) {
  TeacherCache cache(options(dir, "readwrite"), kContext, kNames);
  at::Tensor x = integrityRows();
  std::vector<std::vector<at::Tensor>> batches;
  for (int64_t r = 0; r < kIntegrityRows; r += 8) batches.push_back({x.narrow(0, r, 8)});
  auto out = cache.answer(
      batches, [&](const std::vector<at::Tensor>& in) { return integrityAnswer(in[0], k); }, at::kCPU);
  std::vector<Answer> rows;
  for (auto& b : out) {
    for (int64_t r = 0; r < 8; ++r) rows.push_back(rowOf(b, r));
  }
  EXPECT_EQ(cache.stats().inserted, kIntegrityRows);
  return rows;
}

// Where each row's record lies in data.mdb's bytes: read through LMDB, found in
// the file (every copy: LMDB's copy-on-write leaves older copies of a leaf page
// in pages it has freed; one of them is the live one).
std::vector<std::vector<size_t>> recordOffsets(const std::string& dir, const std::string& file,
                                               std::vector<size_t>* sizes) {
  MDB_env* env = nullptr;
  EXPECT_EQ(mdb_env_create(&env), 0);
  EXPECT_EQ(mdb_env_set_mapsize(env, size_t(64) << 20), 0);
  EXPECT_EQ(mdb_env_open(env, dir.c_str(), MDB_RDONLY, 0600), 0);
  MDB_txn* txn = nullptr;
  MDB_dbi dbi;
  EXPECT_EQ(mdb_txn_begin(env, nullptr, MDB_RDONLY, &txn), 0);
  EXPECT_EQ(mdb_dbi_open(txn, nullptr, 0, &dbi), 0);
  at::Tensor x = integrityRows();
  std::vector<std::vector<size_t>> offsets;
  for (int64_t r = 0; r < kIntegrityRows; ++r) {
    CacheKey k = distill::rowKey(kContext, kNames, {x}, r);
    MDB_val key{k.size(), k.data()}, data;
    EXPECT_EQ(mdb_get(txn, dbi, &key, &data), 0);
    const std::string record(static_cast<const char*>(data.mv_data), data.mv_size);
    offsets.emplace_back();
    for (size_t at = file.find(record); at != std::string::npos; at = file.find(record, at + 1)) {
      offsets.back().push_back(at);
    }
    EXPECT_FALSE(offsets.back().empty()) << "row " << r;
    sizes->push_back(record.size());
  }
  mdb_txn_abort(txn);
  mdb_env_close(env);
  return offsets;
}

struct ReadBack {
  int64_t served = 0, computed = 0, corrupt = 0, wrong = 0;
  std::string log;
  std::string refused; // the ConfigError of a store that would not open (damage where its header lives)
};

// A read job over the store at `dir`: every row asked once, missing rows
// computed (correctly); counts the rows served that differ from `truth`.
ReadBack readBack(const std::string& dir, int64_t k, const std::vector<Answer>& truth) {
  ReadBack r;
  ::testing::internal::CaptureStderr();
  try {
    TeacherCache cache(options(dir, "read"), kContext, kNames);
    at::Tensor x = integrityRows();
    for (int64_t b = 0; b < kIntegrityRows; b += 5) {
      auto out = cache.answer(
          {{x.narrow(0, b, 5)}},
          [&](const std::vector<at::Tensor>& in) {
            r.computed += in[0].size(0);
            return integrityAnswer(in[0], k);
          },
          at::kCPU);
      for (int64_t i = 0; i < 5; ++i) r.wrong += bitEqual(rowOf(out[0], i), truth[size_t(b + i)]) ? 0 : 1;
    }
    r.served = cache.stats().hits;
    r.corrupt = cache.stats().corrupt;
  } catch (const distill::ConfigError& e) {
    r.refused = e.what();
    r.computed = kIntegrityRows; // a job would answer every row by a forward
  }
  r.log = ::testing::internal::GetCapturedStderr();
  return r;
}

// The fault campaign's damage on copies of a good store: one logit changed in
// one row and in every row, a zeroed 4 KiB page, random bit flips. No damaged
// row is ever served: each is a miss (computed again) and counted.
TEST(TeacherCacheIntegrity, DamagedRowsAreMissesNeverServed) {
  for (int64_t k : {0, 4}) {
    SCOPED_TRACE(k == 0 ? "full logits" : "top-4");
    TempDir good;
    const std::vector<Answer> truth = writeIntegrityStore(good.path, k);
    const std::string file = readAll(good.path + "/data.mdb");
    std::vector<size_t> sizes;
    const std::vector<std::vector<size_t>> at = recordOffsets(good.path, file, &sizes);
    {
      StoreCopy intact(file);
      ReadBack r = readBack(intact.path, k, truth);
      EXPECT_EQ(r.served, kIntegrityRows);
      EXPECT_EQ(r.corrupt, 0);
      EXPECT_EQ(r.wrong, 0);
    }
    { // one logit (its last byte) of row 7
      std::string bad = file;
      for (size_t copy : at[7]) bad[copy + sizes[7] - 1] ^= 0x10;
      StoreCopy copy(bad);
      ReadBack r = readBack(copy.path, k, truth);
      EXPECT_EQ(r.wrong, 0);
      EXPECT_EQ(r.corrupt, 1);
      EXPECT_EQ(r.served, kIntegrityRows - 1);
      EXPECT_EQ(r.computed, 1);
      const std::string key = distill::keyHex(distill::rowKey(kContext, kNames, {integrityRows()}, 7));
      EXPECT_NE(r.log.find("teacher cache " + copy.path + ": the row with key " + key + " is damaged"),
                std::string::npos)
          << r.log;
    }
    { // one value in every row
      std::string bad = file;
      for (int64_t r = 0; r < kIntegrityRows; ++r) {
        for (size_t copy : at[size_t(r)]) bad[copy + sizes[size_t(r)] - 2] ^= 0x01;
      }
      StoreCopy copy(bad);
      ReadBack r = readBack(copy.path, k, truth);
      EXPECT_EQ(r.wrong, 0);
      EXPECT_EQ(r.corrupt, kIntegrityRows);
      EXPECT_EQ(r.served, 0);
    }
    { // the 4 KiB page holding the middle of row 20's record (each copy's)
      std::string bad = file;
      for (size_t copy : at[20]) std::memset(&bad[(copy + sizes[20] / 2) / 4096 * 4096], 0, 4096);
      StoreCopy copy(bad);
      ReadBack r = readBack(copy.path, k, truth);
      EXPECT_EQ(r.wrong, 0);
      EXPECT_TRUE(r.corrupt >= 1 || r.refused.find(copy.path) != std::string::npos) << r.refused;
      EXPECT_EQ(r.served + r.computed, kIntegrityRows);
    }
    for (uint32_t seed = 1; seed <= 6; ++seed) { // 20 random bit flips past the two meta pages
      SCOPED_TRACE(seed);
      std::string bad = file;
      std::mt19937 rng(seed);
      std::set<size_t> recordsHit;
      for (int i = 0; i < 20; ++i) {
        const size_t byte = 8192 + rng() % (file.size() - 8192);
        bad[byte] ^= char(1u << (rng() % 8));
        for (size_t r = 0; r < at.size(); ++r) { // records with one copy only: that one is live
          if (at[r].size() == 1 && byte >= at[r][0] + 8 && byte < at[r][0] + sizes[r]) recordsHit.insert(r);
        }
      }
      StoreCopy copy(bad);
      ReadBack r = readBack(copy.path, k, truth);
      EXPECT_EQ(r.wrong, 0);
      EXPECT_EQ(r.served + r.computed, kIntegrityRows);
      if (r.refused.empty()) {
        EXPECT_GE(r.corrupt, int64_t(recordsHit.size())) << r.log;
      } else {
        EXPECT_NE(r.refused.find(copy.path), std::string::npos) << r.refused;
      }
      std::printf("%s, seed %u: 20 bit flips, %zu records hit: %lld served, %lld computed, %lld counted damaged%s\n",
                  k == 0 ? "full logits" : "top-4", seed, recordsHit.size(), static_cast<long long>(r.served),
                  static_cast<long long>(r.computed), static_cast<long long>(r.corrupt),
                  r.refused.empty() ? "" : ", store refused");
    }
  }
}

std::vector<std::string> listDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

mode_t modeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

void expectRefused(const std::string& dir, const std::vector<std::string>& parts) {
  for (const char* mode : {"read", "readwrite"}) {
    try {
      TeacherCache c(options(dir, mode), kContext, kNames);
      ADD_FAILURE() << "no ConfigError (mode " << mode << ")";
    } catch (const distill::ConfigError& e) {
      for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

// The store is created owner-only; a folder or file another user owns or can
// write is refused, naming the path and its mode.
TEST(TeacherCacheIntegrity, StoreOthersCanChangeIsRefused) {
  TempDir dir;
  { TeacherCache c(options(dir.path, "readwrite"), kContext, kNames); }
  EXPECT_EQ(modeOf(dir.path), 0700u);
  EXPECT_EQ(modeOf(dir.path + "/data.mdb"), 0600u);
  EXPECT_EQ(modeOf(dir.path + "/lock.mdb"), 0600u);
  ASSERT_EQ(::chmod(dir.path.c_str(), 0770), 0);
  expectRefused(dir.path, {dir.path + " has mode 0770, writable by its group", "chmod go-w"});
  ASSERT_EQ(::chmod(dir.path.c_str(), 0702), 0);
  expectRefused(dir.path, {dir.path + " has mode 0702, writable by others"});
  ASSERT_EQ(::chmod(dir.path.c_str(), 0755), 0); // readable by others is fine
  { TeacherCache c(options(dir.path, "read"), kContext, kNames); }
  ASSERT_EQ(::chmod((dir.path + "/data.mdb").c_str(), 0666), 0);
  expectRefused(dir.path, {dir.path + "/data.mdb has mode 0666"});
  ASSERT_EQ(::chmod((dir.path + "/data.mdb").c_str(), 0600), 0);
  if (::geteuid() != 0) GTEST_SKIP() << "another owner needs root (chown)";
  ASSERT_EQ(::chown((dir.path + "/data.mdb").c_str(), 65534, 65534), 0);
  expectRefused(dir.path, {dir.path + "/data.mdb belongs to uid 65534", "not to this process's user (uid 0"});
  ASSERT_EQ(::chown((dir.path + "/data.mdb").c_str(), 0, 0), 0);
  ASSERT_EQ(::chown(dir.path.c_str(), 65534, 65534), 0);
  expectRefused(dir.path, {dir.path + " belongs to uid 65534"});
  ASSERT_EQ(::chown(dir.path.c_str(), 0, 0), 0);
}

// A truncated data.mdb (half, 8 KiB) is an error naming the store, never a
// SIGBUS; with on_corrupt restart it is set aside and a new store started.
TEST(TeacherCacheIntegrity, TruncatedStoreIsAnErrorOrSetAside) {
  TempDir good;
  const std::vector<Answer> truth = writeIntegrityStore(good.path, 0);
  const std::string file = readAll(good.path + "/data.mdb");
  ASSERT_GT(file.size(), size_t(64) << 10);
  for (size_t size : {file.size() / 2, size_t(8192)}) {
    SCOPED_TRACE(size);
    StoreCopy copy(file.substr(0, size));
    expectRefused(copy.path,
                  {"the store in " + copy.path + " is damaged: data.mdb holds " + std::to_string(size) + " bytes",
                   "truncated", "teacher.cache.on_corrupt: restart"});
    auto o = options(copy.path, "readwrite");
    o.on_corrupt = distill::OnCorrupt::kRestart;
    TeacherCache fresh(o, kContext, kNames);
    at::Tensor x = integrityRows();
    auto out = fresh.answer(
        {{x.narrow(0, 0, 4)}}, [&](const std::vector<at::Tensor>& in) { return integrityAnswer(in[0], 0); }, at::kCPU);
    EXPECT_EQ(fresh.stats().hits, 0);
    EXPECT_EQ(fresh.stats().inserted, 4);
    EXPECT_TRUE(bitEqual(rowOf(out[0], 3), truth[3]));
    // The damaged file is kept beside it, whole.
    bool kept = false;
    for (const std::string& name : listDir(copy.path)) {
      if (name.rfind("data.mdb.corrupt-", 0) == 0) {
        kept = readAll(copy.path + "/" + name).size() == size;
        ::unlink((copy.path + "/" + name).c_str());
      }
    }
    EXPECT_TRUE(kept);
  }
}

// An empty data.mdb (a first write that never happened) is said as such, with
// the on_corrupt hint, not as LMDB's "Bad file descriptor"; restart sets it aside.
TEST(TeacherCacheIntegrity, EmptyStoreFileIsSaidSo) {
  StoreCopy copy("");
  expectRefused(copy.path, {"the store in " + copy.path + " is damaged: data.mdb is an empty store file (0 bytes)",
                            "teacher.cache.on_corrupt: restart"});
  auto o = options(copy.path, "readwrite");
  o.on_corrupt = distill::OnCorrupt::kRestart;
  TeacherCache fresh(o, kContext, kNames);
  at::Tensor x = integrityRows();
  fresh.answer(
      {{x.narrow(0, 0, 4)}}, [&](const std::vector<at::Tensor>& in) { return integrityAnswer(in[0], 0); }, at::kCPU);
  EXPECT_EQ(fresh.stats().inserted, 4);
  for (const std::string& name : listDir(copy.path)) {
    if (name.rfind("data.mdb.corrupt-", 0) == 0) ::unlink((copy.path + "/" + name).c_str());
  }
}

// teacher.cache.keys prefix: a damaged record is a position's, and said so.
TEST(TeacherCacheIntegrity, DamagedPositionIsSaidToBeAPosition) {
  TempDir dir;
  auto o = options(dir.path, "readwrite");
  o.keys = distill::CacheKeys::kPrefix;
  const at::Tensor x = ids(2, 8, 77);
  auto compute = [](const std::vector<at::Tensor>& in) { return shaped(in[0], 0, 64); };
  { TeacherCache(o, kContext, kNames).answer({{x}}, compute, at::kCPU); }
  const CacheKey k = distill::positionKeys(kContext, kNames, {x}, 1)[3];
  { // garbage under row 1's position 3
    MDB_env* env = nullptr;
    ASSERT_EQ(mdb_env_create(&env), 0);
    ASSERT_EQ(mdb_env_set_mapsize(env, size_t(64) << 20), 0);
    ASSERT_EQ(mdb_env_open(env, dir.path.c_str(), 0, 0600), 0);
    MDB_txn* txn = nullptr;
    MDB_dbi dbi;
    ASSERT_EQ(mdb_txn_begin(env, nullptr, 0, &txn), 0);
    ASSERT_EQ(mdb_dbi_open(txn, nullptr, 0, &dbi), 0);
    std::string junk(40, 'x');
    MDB_val key{k.size(), const_cast<uint8_t*>(k.data())}, data{junk.size(), junk.data()};
    ASSERT_EQ(mdb_put(txn, dbi, &key, &data, 0), 0);
    ASSERT_EQ(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
  }
  ::testing::internal::CaptureStderr();
  TeacherCache cache(o, kContext, kNames);
  cache.answer({{x}}, compute, at::kCPU);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(cache.stats().corrupt, 1);
  EXPECT_NE(err.find("the position with key " + distill::keyHex(k) + " is damaged"), std::string::npos) << err;
  EXPECT_EQ(err.find("the row with key"), std::string::npos) << err;
}

// A commit that fails (a full or failing disk) stops inserts with one warning
// saying why; answers and lookups go on.
TEST(TeacherCacheIntegrity, FailedCommitStopsInsertingOnce) {
  for (int fault : {EIO, ENOSPC, MDB_MAP_FULL}) {
    SCOPED_TRACE(fault);
    TempDir dir;
    TeacherCache::Faults faults;
    faults.commit = [&](int64_t n) { return n == 3 ? fault : 0; };
    TeacherCache cache(options(dir.path, "readwrite"), kContext, kNames, 1.0, faults);
    auto compute = [](const std::vector<at::Tensor>& in) { return shaped(in[0], 0, 128); };
    ::testing::internal::CaptureStderr();
    for (uint64_t seed = 300; seed < 310; ++seed) {
      at::Tensor x = ids(4, 16, seed);
      std::vector<Answer> a = cache.answer({{x}}, compute, at::kCPU);
      EXPECT_TRUE(bitEqual(a[0].at("logits"), asStored(tableLogits(x, 128))));
    }
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(cache.full());
    EXPECT_EQ(cache.maxBytesReached(), fault == MDB_MAP_FULL);
    EXPECT_EQ(cache.stats().inserted, 8); // the first two commits
    // ENOSPC is said as no space left; EIO on a disk with room stays an I/O error.
    const std::string said = fault == MDB_MAP_FULL ? dir.path + " is full (teacher.cache.max_bytes="
        : fault == ENOSPC ? dir.path + " cannot store rows: no space left on the file system of " + dir.path
                          : dir.path + " cannot store rows: commit failed: " + mdb_strerror(fault);
    EXPECT_NE(err.find(said), std::string::npos) << err;
    EXPECT_EQ(err.find("no more rows are stored"), err.rfind("no more rows are stored")) << "said twice: " << err;
    // What was committed before still hits.
    cache.answer({{ids(4, 16, 301)}}, compute, at::kCPU);
    EXPECT_EQ(cache.stats().hits, 4);
  }
}

// The same with a real full disk: a 2 MiB tmpfs under a store whose max_bytes is 64 MiB.
TEST(TeacherCacheIntegrity, FullDiskStopsInserting) {
  TempDir dir;
  ASSERT_EQ(::mkdir(dir.path.c_str(), 0700), 0);
  if (::mount("tmpfs", dir.path.c_str(), "tmpfs", 0, "size=2m,mode=0700") != 0) {
    const int err = errno;
    ::rmdir(dir.path.c_str());
    GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(err);
  }
  const std::string store = dir.path + "/store";
  {
    TeacherCache cache(options(store, "readwrite"), kContext, kNames);
    auto compute = [](const std::vector<at::Tensor>& in) { return shaped(in[0], 0, 1024); }; // 32 KiB a row
    ::testing::internal::CaptureStderr();
    for (uint64_t seed = 400; seed < 440; ++seed) { // 5 MiB of rows
      at::Tensor x = ids(4, 16, seed);
      std::vector<Answer> a = cache.answer({{x}}, compute, at::kCPU);
      EXPECT_TRUE(bitEqual(a[0].at("logits"), asStored(tableLogits(x, 1024))));
    }
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(cache.full());
    EXPECT_FALSE(cache.maxBytesReached());
    EXPECT_NE(err.find(store + " cannot store rows: "), std::string::npos) << err;
    // LMDB says EIO for a short write (mdb_page_flush), ENOSPC when nothing was written: either
    // way the message says what is so (issue 39 item 3), with the bytes free.
    EXPECT_NE(err.find(store + " cannot store rows: no space left on the file system of " + store), std::string::npos)
        << err;
    EXPECT_NE(err.find(" bytes free, a write of about "), std::string::npos) << err;
    const int64_t hits = cache.stats().hits;
    cache.answer({{ids(4, 16, 400)}}, compute, at::kCPU);
    EXPECT_EQ(cache.stats().hits, hits + 4);
  }
  ::unlink((store + "/data.mdb").c_str());
  ::unlink((store + "/lock.mdb").c_str());
  ::rmdir(store.c_str());
  ::umount(dir.path.c_str());
}

// Bytes per stored token of a dense (full-logits) row, float32 (as stored before:
// a raw float32 tensor) and as stored now (float16), for a 1551- and a 32000-entry
// vocabulary, 64 tokens a row; and what float16 full logits do to the loss.

} // namespace
