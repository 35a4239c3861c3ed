#pragma once

// The teacher-output cache's records (cache.h): a row's (or, with prefix keys,
// a position's) answer as the store holds it, and back. Internal to teacher/.
//
// Stored rows (teacher.cache.dtype float16, the default): float32 full logits
// and top-k values as float16 (a row with a
// value outside float16's range stays float32: float16 rather than bfloat16
// because logits span a small range, where float16's 11-bit significand keeps
// 8 times bfloat16's precision); logits of another dtype and hidden states in
// their own dtype; token ids (top-k indices, sampled ids) in the narrowest
// unsigned integer that holds the vocabulary (uint8, uint16, else int32),
// sampled counts as their int16, logsumexp and log_tail float32. Every
// answer, hit or miss, is decoded from its record, so the rounding is the same
// in every epoch and reads give float32 as before. A computed top-k answer is
// first rounded as stored (roundForStorage): its logsumexp is then recomputed
// from the rounded values and log_tail, since the student's loss checks that
// the k + 1 buckets sum to 1 within 1e-4.
// So with float16 rows a job's answers differ from those it gets with the
// cache off (in the last digits: float16 keeps 11 bits). teacher.cache.dtype
// float32 stores float32 logits and values as they are and rounds nothing: a
// cached job's answers are then the uncached job's, bit for bit (twice the
// bytes per row). The answer context names float32 rows, so the two kinds
// never answer each other.
//
// Integrity: every record carries a CRC32C over its key and its bytes, checked
// on every read (recordIntact, by the store's lookup).
//
// Pure functions of their arguments: any thread.

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "distill/core/options.h"
#include "keys.h"

namespace distill {

using Answer = std::map<std::string, at::Tensor>; // by protocol name, dim 0 = rows

// A row's answer (each tensor [1, ...], CPU) as stored, and back. `vocab`:
// the logits' last dimension (top-k indices and sampled ids are stored in the narrowest
// integer that holds it). `key`: the row's key, which the record's CRC32C
// covers with its bytes (so a record moved under another key fails it too).
// decodeRow throws IpcError on a malformed record; it does not check the CRC.
// kPosition (prefix keys): one position, each tensor [1, 1, ...], in a compact
// layout (names of the protocol as a byte, dims as uint32, no byte counts):
// about 65 bytes for a top-8 position against 180 in a row's layout.
enum class RecordKind : uint8_t { kRow, kPosition };
// `dtype` float32: float32 logits and top-k values stored as they are, not as float16.
std::string encodeRow(const Answer& row, int64_t vocab, const CacheKey& key = {}, RecordKind kind = RecordKind::kRow,
                      CacheDtype dtype = CacheDtype::kFloat16);
Answer decodeRow(const void* data, size_t size);
// Does the record at `data` carry the right CRC32C for `key` and its bytes?
bool recordIntact(const CacheKey& key, const void* data, size_t size);

// A top-k answer (any rows) as the store holds it: topk_values rounded to
// float16 where float16 holds them, logsumexp = logaddexp(logsumexp(values /
// T), log_tail) of the rounded values. Other answers are left as they are.
void roundForStorage(Answer& answer, double temperature);

} // namespace distill
