#pragma once

// The teacher-output cache (teacher.cache): each row of a request (one index
// along the batch dimension of its inputs) is looked up by a key made of its
// content and of everything else that shapes its answer; rows found are
// answered from the store without a forward, the others are computed in one
// forward, stored, and answered with exactly the bytes stored. So a row's
// answer is the same bytes whether it hit or missed, in any epoch, batch
// position, batch size or student run.
//
// Key: SHA-256 (OpenSSL's libcrypto, which core already links for the
// rendezvous store) of the answer context's digest and, for every input named
// by teacher.inputs, its name, dtype, trailing shape and the row's bytes. A
// cryptographic hash because a collision would silently serve another row's
// answer; it costs about 2 ns per byte here, small next to any forward.
//
// Answer context (every key holds it, so two teachers never share an entry):
// the cache format version, the teacher's fingerprint (a SHA-256 over every
// parameter's and buffer's name, dtype, shape and bytes, plus kind, method and
// output names), the output kind (full logits, or top-k k and the loss
// temperature, on which logsumexp and log_tail depend), the hidden states,
// autocast and the device type.
//
// Stored rows: full logits and hidden states in their own dtype (no rounding);
// top-k values as float16 (a row with a value outside float16's range stays
// float32), indices in the narrowest unsigned integer that holds the
// vocabulary (uint8, uint16, else int32), logsumexp and log_tail float32.
// A computed top-k answer is first rounded as stored (roundForStorage): its
// logsumexp is then recomputed from the rounded values and log_tail, since the
// student's loss checks that the k + 1 buckets sum to 1 within 1e-4.
//
// Store: one LMDB environment per path, shared by every teacher of the node
// (LMDB's lock file; readers of dead processes cleared at open); one write
// transaction per batch. A process killed mid-write leaves the last committed
// state. A store of another cache format is refused. When the store reaches
// teacher.cache.max_bytes inserts stop with one warning; lookups go on.
//
// Not thread-safe: the teacher server's thread only.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distill/core/options.h"
#include "distill/teacher/model.h"

namespace distill {

constexpr uint32_t kCacheFormatVersion = 1;

using CacheKey = std::array<uint8_t, 32>;
using Answer = std::map<std::string, at::Tensor>; // by protocol name, dim 0 = rows

// The digest of everything about the teacher that shapes an answer besides the
// row's inputs (see above). ConfigError if the model exposes neither its
// tensors nor a fingerprint: two such teachers could not be kept apart.
std::string answerContext(const TeacherOptions& teacher, double temperature, const TeacherModel& model);

// SHA-256 over the model's named parameters and buffers (name, dtype, shape,
// bytes), hex; "" if it exposes none.
std::string modelDigest(const TeacherModel& model);

// The key of row `row` of the inputs (teacher.inputs order, dim 0 = rows).
CacheKey rowKey(const std::string& context, const std::vector<std::string>& names,
                const std::vector<at::Tensor>& inputs, int64_t row);

// A row's answer (each tensor [1, ...], CPU) as stored, and back. `vocab`:
// the logits' last dimension (top-k indices are stored in the narrowest
// integer that holds it). decodeRow throws IpcError on a malformed record.
std::string encodeRow(const Answer& row, int64_t vocab);
Answer decodeRow(const void* data, size_t size);

// A top-k answer (any rows) as the store holds it: topk_values rounded to
// float16 where float16 holds them, logsumexp = logaddexp(logsumexp(values /
// T), log_tail) of the rounded values. Other answers are left as they are.
void roundForStorage(Answer& answer, double temperature);

struct CacheStats {
  int64_t rows = 0, hits = 0; // rows looked up (or computed, mode write) and found
  int64_t tokens = 0, hitTokens = 0;
  int64_t inserted = 0; // rows written
  int64_t forwards = 0; // forward calls made through answer()
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

  // Opens (or creates, unless mode read) the store of `options.path`.
  // ConfigError naming the path: no store there in mode read, another format
  // version, or LMDB refusing to open it.
  // `temperature`: loss.temperature, at which top-k answers' logsumexp is taken.
  TeacherCache(const TeacherOptions::CacheOptions& options, std::string context, std::vector<std::string> names,
               double temperature = 1.0);
  ~TeacherCache();
  TeacherCache(const TeacherCache&) = delete;
  TeacherCache& operator=(const TeacherCache&) = delete;

  // Answers requests (each its inputs, teacher.inputs order, rows along dim 0):
  // looks every row up (modes read, readwrite), computes all missing rows of
  // all requests with ONE call of `compute`, stores them (modes write,
  // readwrite) and returns each request's answer, rows in their order, every
  // row decoded from its stored bytes, on `device`.
  std::vector<Answer> answer(const std::vector<std::vector<at::Tensor>>& requests, const Compute& compute,
                             const at::Device& device);

  const CacheStats& stats() const { return stats_; }
  // Bytes the store's file uses now.
  int64_t storeBytes() const;
  const std::string& path() const { return path_; }
  bool full() const { return full_; }

 private:
  std::optional<std::string> lookup(const CacheKey& key);
  void insert(const std::vector<std::pair<CacheKey, std::string>>& rows);

  struct Env;
  std::unique_ptr<Env> env_;
  std::string path_;
  std::string context_;
  std::vector<std::string> names_;
  double temperature_;
  int64_t maxBytes_;
  bool reads_, writes_;
  bool full_ = false;
  CacheStats stats_;
};

} // namespace distill
