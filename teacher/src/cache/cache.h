#pragma once

// The teacher-output cache (teacher.cache): each row of a request (one index
// along the batch dimension of its inputs) is looked up by a key made of its
// content and of everything else that shapes its answer; rows found are
// answered from the store without a forward, the others are computed in one
// forward, stored, and answered with exactly the bytes stored. So a row's
// answer is the same bytes whether it hit or missed, in any epoch, batch
// position, batch size or student run.
//
// The room (teacher/src/cache/): keys.h (SHA-256 keys, the answer context,
// row and position keys), records.h (the record codec, its CRC32C, the
// rounding for storage), store.cpp (the LMDB store), cache.cpp (answering
// rows), prefix.cpp (prefix keys), files.h (the store's folder and files).
// This header includes the pieces' headers; none of them includes it.
//
// Integrity: a record that fails its CRC32C (or that LMDB cannot reach:
// a damaged page) is a miss, never served, counted (CacheStats::corrupt) and
// logged naming the store and the key. Against accidents, not an attacker:
// the store's folder and files must belong to this process's user and be
// writable by no one else (refused at open, naming the path and its mode);
// they are created 0700 / 0600.
//
// Signal: a store holds the answers of one teacher (its weights) of one kind
// (the answer context, keys.h, stored in the store at its creation). A teacher
// whose context differs is refused at open (ConfigError naming the store, what
// it holds and what this teacher answers), never served another's rows.
// Sampled answers: their K, temperature and run.seed are in the context, so
// other draws are refused too, not missed; a row computed here draws what it
// would draw without the cache (computingRows), a hit returns its first draws.
//
// Store: one LMDB environment per path, shared by every teacher of the node
// (LMDB's lock file; readers of dead processes cleared at open); one write
// transaction per batch. A process killed mid-write leaves the last committed
// state. A store of another cache format is refused. A store whose data.mdb is
// shorter than its own meta page says (truncated: reading it would SIGBUS) or
// that LMDB finds invalid is an error naming the path, or with
// teacher.cache.on_corrupt: restart is set aside (data.mdb.corrupt-...) and a
// new one started. When the store reaches teacher.cache.max_bytes, or a write
// fails (a full or failing disk: ENOSPC, EIO), inserts stop with one warning
// saying why; lookups go on, and the job with them.
//
// Prefix keys (teacher.cache.keys: prefix, for a causal teacher whose answer
// at position t depends on inputs[0..t] alone): one record per position,
// keyed by a chain over the row's positions (keys.h); a record of
// RecordKind::kPosition.
// The G rows of an on-policy group share their prompt's keys, so the prompt
// is shaped and stored once, and a new sample of a prompt answered before
// finds it. A row whose positions all hit
// is answered without a forward; the rows with a miss run whole (a TorchScript
// teacher has no KV cache), and only their missing positions are shaped
// (top-k, rounding), encoded and stored. Every position is decoded from its
// record's bytes, as rows are. A position met twice in one batch (a group's
// prompt) is computed once.
//
// Not thread-safe: the teacher server's thread only.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "distill/core/options.h"
#include "keys.h"
#include "records.h"

struct MDB_txn; // lmdb.h

namespace distill {

// teacher.cache.keys prefix: the model's outputs `names` of `raw` ([M, T, ...];
// every one when `names` is empty) at `positions` (int64 [N], flat indices row * T + t) as [N, 1, ...].
// ProtocolError naming teacher.cache.keys when one has no sequence dimension of T.
std::map<std::string, at::Tensor> gatherPositions(const std::map<std::string, at::Tensor>& raw,
                                                  const std::vector<std::string>& names, const at::Tensor& positions,
                                                  int64_t seq);

// The rows (request, row) of `requests`, every input gathered along dim 0 in
// their order: runs of consecutive rows of one request taken as one slice.
std::vector<at::Tensor> gatherRows(const std::vector<std::vector<at::Tensor>>& requests,
                                   const std::vector<std::pair<size_t, int64_t>>& rows);

// The one definition of the cache hit share, used by the teacher's summary,
// the segment's gauges, distill-run's status line and its balance verdict:
// hits / lookups (rows looked up in the store; none in mode write).
struct CacheStats {
  int64_t rows = 0, tokens = 0; // rows (and their tokens) answered through the cache
  int64_t lookups = 0; // rows looked up in the store (modes read, readwrite)
  int64_t hits = 0, hitTokens = 0; // lookups answered from the store
  int64_t inserted = 0, insertedTokens = 0; // rows (tokens) this process stored
  int64_t storedBytes = 0; // what those rows take in the store (record, key, LMDB's page rounding)
  int64_t corrupt = 0; // lookups whose record failed its CRC32C or could not be read: misses
  int64_t forwards = 0; // forward calls made through answer()
  // teacher.cache.keys prefix: positions of the rows answered (all looked up in modes read and
  // readwrite), those found in the store, and those computed (shaped, encoded, stored): a position
  // met twice in one batch is computed once, so computed <= positions - positionHits.
  int64_t positions = 0, positionHits = 0, positionsComputed = 0;
};

class TeacherCache {
 public:
  // The answer (shaped output, dim 0 = rows) of gathered inputs, and the
  // vocabulary of the logits it was shaped from.
  struct Computed {
    Answer answer;
    int64_t vocab = 0;
  };
  using Compute = std::function<Computed(const std::vector<at::Tensor>& inputs)>;
  // With the positions wanted: undefined (row keys: every position, [M, T, ...]),
  // or (prefix keys) int64 [N] flat indices row * T + t into the inputs' rows,
  // whose answers alone are shaped: [N, 1, ...] (gatherPositions).
  using ComputePositions = std::function<Computed(const std::vector<at::Tensor>& inputs, const at::Tensor& positions)>;

  // Fault injection (tests): `commit`, when set, is called before the nth
  // commit of rows (n from 1); a non-zero return (an errno or an LMDB code) is
  // taken as that commit's result, the transaction being aborted instead.
  struct Faults {
    std::function<int(int64_t n)> commit;
  };

  // Opens (or creates, unless mode read) the store of `options.path`.
  // ConfigError naming the path: no store there in mode read, another format
  // version, a folder or file of another user or writable by group or others
  // (with its mode), a truncated or invalid store (unless options.on_corrupt
  // is restart, modes write and readwrite: then set aside and started anew),
  // or LMDB refusing to open it.
  // `temperature`: loss.temperature, at which top-k answers' logsumexp is taken.
  TeacherCache(const TeacherOptions::CacheOptions& options, std::string context, std::vector<std::string> names,
               double temperature = 1.0, Faults faults = {});
  ~TeacherCache();
  TeacherCache(const TeacherCache&) = delete;
  TeacherCache& operator=(const TeacherCache&) = delete;

  // Answers requests (each its inputs, teacher.inputs order, rows along dim 0):
  // looks every row up (modes read, readwrite), computes all missing rows of
  // all requests with ONE call of `compute`, stores them (modes write,
  // readwrite) and returns each request's answer, rows in their order, every
  // row decoded from its stored bytes, on `device`.
  std::vector<Answer> answer(const std::vector<std::vector<at::Tensor>>& requests, const ComputePositions& compute,
                             const at::Device& device);
  // The same with a compute that shapes every position (prefix keys: the
  // positions wanted are taken from its answer).
  std::vector<Answer> answer(const std::vector<std::vector<at::Tensor>>& requests, const Compute& compute,
                             const at::Device& device);

  // During a call of `compute`: the (request, row) of each of its input rows,
  // in their order (the rows gathered: a subset of the requests' rows); empty
  // outside one. Sampled answers key each row's draws by its request and row
  // (teacher/src/pending.h's sampleKeys), so that a row computed here draws
  // what it would draw without the cache.
  const std::vector<std::pair<size_t, int64_t>>& computingRows() const { return computing_; }

  const CacheStats& stats() const { return stats_; }
  // The hit share's (lookups, hits), as the segment publishes them: rows, or
  // with prefix keys positions (a group's rows rarely all hit: new responses).
  std::pair<int64_t, int64_t> hitShareCounts() const {
    if (keys_ != CacheKeys::kPrefix) return {stats_.lookups, stats_.hits};
    return {reads_ ? stats_.positions : 0, stats_.positionHits};
  }
  // Bytes the store's file uses now.
  int64_t storeBytes() const;
  const std::string& path() const { return path_; }
  // No more inserts: max_bytes reached, or a write failed (stopReason() says which).
  bool full() const { return full_; }
  const std::string& stopReason() const { return stopReason_; }
  bool maxBytesReached() const { return maxBytesReached_; } // full, and because of max_bytes
  // Bytes the store spends per token stored by this process (0 before any).
  double bytesPerStoredToken() const;
  // The exit summary: "teacher cache PATH: R rows (T tokens), L looked up, H hits (x% of the rows looked up, ...".
  std::string summary() const;

 private:
  void open(const TeacherOptions::CacheOptions& options);
  std::string checkOpened(); // "" or why the opened store is unusable
  void setAside();
  void readHeader();
  bool checkSignal(MDB_txn* txn);
  std::optional<std::string> lookup(const CacheKey& key);
  void noteCorrupt(const CacheKey& key, const std::string& why);
  void stopInserting(const std::string& why);
  void insert(const std::vector<std::pair<CacheKey, std::string>>& rows, const std::vector<int64_t>& tokens);
  std::vector<Answer> answerRows(const std::vector<std::vector<at::Tensor>>& requests, const ComputePositions& compute,
                                 const at::Device& device);
  // One call of `compute` on `rows` (request, row) of `requests`, computingRows() set during it.
  Computed computeRows(const std::vector<std::vector<at::Tensor>>& requests,
                       const std::vector<std::pair<size_t, int64_t>>& rows, const at::Tensor& positions,
                       const ComputePositions& compute);
  struct PrefixBatch; // prefix.cpp
  void lookupPositions(PrefixBatch& b, const std::vector<std::vector<at::Tensor>>& requests);
  void computePositions(PrefixBatch& b, const std::vector<std::vector<at::Tensor>>& requests,
                        const ComputePositions& compute);
  std::vector<Answer> answerPrefix(const std::vector<std::vector<at::Tensor>>& requests,
                                   const ComputePositions& compute, const at::Device& device); // prefix.cpp

  struct Env;
  std::unique_ptr<Env> env_;
  std::string path_;
  std::string context_;
  std::vector<std::string> names_;
  double temperature_;
  CacheKeys keys_;
  CacheDtype dtype_; // teacher.cache.dtype
  int64_t maxBytes_;
  bool reads_, writes_;
  bool full_ = false;
  bool readable_ = true; // false once LMDB refuses to read at all (MDB_PANIC): every row computed
  std::string stopReason_;
  bool maxBytesReached_ = false;
  Faults faults_;
  int64_t commits_ = 0;
  std::set<CacheKey> damaged_; // keys whose record failed its CRC: replaced at the next insert
  std::vector<std::pair<size_t, int64_t>> computing_; // computingRows()
  CacheStats stats_;
};

} // namespace distill
