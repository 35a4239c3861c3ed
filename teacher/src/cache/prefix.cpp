// The teacher-output cache with prefix keys (teacher.cache.keys: prefix,
// cache.h): one record per position, keyed by the chain over its prefix; the
// rows of a batch looked up position by position, the rows with a miss
// forwarded whole, only their missing positions shaped and stored, and every
// position decoded from its record.
#include <algorithm>
#include <map>
#include <optional>

#include "cache.h"
#include "distill/core/errors.h"

namespace distill {

std::map<std::string, at::Tensor> gatherPositions(const std::map<std::string, at::Tensor>& raw,
                                                  const std::vector<std::string>& names, const at::Tensor& positions,
                                                  int64_t seq) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : raw) {
    if (!names.empty() && std::find(names.begin(), names.end(), name) == names.end()) continue;
    DISTILL_CHECK_T(ProtocolError, t.dim() >= 2 && t.size(1) == seq,
                    "teacher.cache.keys: prefix keys answers per position, but the teacher's output '", name,
                    "' has shape ", t.sizes(), " for inputs of ", seq,
                    " positions (dim 1); it needs a teacher that answers every position, [B, T, ...], whose "
                    "answer at position t depends on inputs[0..t] alone; else set teacher.cache.keys to row");
    std::vector<int64_t> flat = t.sizes().vec();
    flat.erase(flat.begin());
    flat[0] = t.size(0) * seq;
    out[name] = t.reshape(flat).index_select(0, positions.to(t.device())).unsqueeze(1);
  }
  return out;
}

// One batch of requests under prefix keys: where each position's record is.
struct TeacherCache::PrefixBatch {
  std::vector<std::string> pool; // the batch's distinct positions' records ("" until computed)
  std::map<CacheKey, size_t> slot; // a position's key -> its record in pool
  std::vector<at::Tensor> where; // per request: int64 [rows * T], each position's slot in pool
  std::vector<std::pair<size_t, int64_t>> forward; // rows (request, row) with a position to compute
  std::vector<int64_t> flat; // the positions to compute: index into forward * T + t
  std::vector<CacheKey> flatKeys; // their keys
  std::vector<size_t> flatSlots; // their slots in pool
  int64_t seq = 0;
};

void TeacherCache::lookupPositions(PrefixBatch& b, const std::vector<std::vector<at::Tensor>>& requests) {
  for (size_t q = 0; q < requests.size(); ++q) {
    std::vector<at::Tensor> host;
    for (const at::Tensor& t : requests[q]) host.push_back(t.contiguous().cpu());
    const int64_t rows = host.at(0).size(0);
    const int64_t seq = host[0].dim() >= 2 ? host[0].size(1) : 0;
    DISTILL_INTERNAL_ASSERT(b.seq == 0 || seq == b.seq, "a batch of requests of one sequence length");
    b.seq = seq;
    at::Tensor where = at::empty({rows * std::max<int64_t>(seq, 1)}, at::kLong);
    int64_t* w = where.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<CacheKey> keys = positionKeys(context_, names_, host, r);
      ++stats_.rows;
      stats_.tokens += seq;
      stats_.lookups += reads_ ? 1 : 0;
      bool miss = false, allHit = reads_;
      for (int64_t t = 0; t < seq; ++t) {
        ++stats_.positions;
        const CacheKey& key = keys[size_t(t)];
        auto it = b.slot.find(key);
        if (it == b.slot.end()) {
          std::optional<std::string> record = reads_ ? lookup(key) : std::nullopt;
          it = b.slot.emplace(key, b.pool.size()).first;
          b.pool.push_back(record ? std::move(*record) : std::string());
          if (!record) { // computed from this row
            miss = true;
            b.flat.push_back(int64_t(b.forward.size()) * seq + t);
            b.flatKeys.push_back(key);
            b.flatSlots.push_back(it->second);
          }
        }
        w[r * seq + t] = int64_t(it->second);
        const bool stored = !b.pool[it->second].empty(); // else computed in this batch
        stats_.positionHits += stored ? 1 : 0;
        allHit = allHit && stored;
      }
      if (miss) b.forward.emplace_back(q, r);
      if (allHit) {
        ++stats_.hits;
        stats_.hitTokens += seq;
      }
    }
    b.where.push_back(where);
  }
}

// The rows with a miss in one forward; their missing positions shaped, encoded and stored.
void TeacherCache::computePositions(PrefixBatch& b, const std::vector<std::vector<at::Tensor>>& requests,
                                    const ComputePositions& compute) {
  if (b.forward.empty()) return;
  const int64_t n = int64_t(b.flat.size());
  Computed computed = computeRows(requests, b.forward, at::tensor(b.flat, at::kLong), compute);
  if (dtype_ == CacheDtype::kFloat16) roundForStorage(computed.answer, temperature_);
  Answer host;
  for (auto& [name, t] : computed.answer) {
    DISTILL_CHECK_T(ProtocolError, t.dim() >= 2 && t.size(0) == n && t.size(1) == 1, "teacher.cache.keys: ", n,
                    " positions were asked for, the teacher's '", name, "' holds ", t.sizes());
    host[name] = t.cpu();
  }
  std::vector<std::pair<CacheKey, std::string>> records;
  for (int64_t i = 0; i < n; ++i) {
    Answer position;
    for (auto& [name, t] : host) position[name] = t.narrow(0, i, 1);
    std::string record = encodeRow(position, computed.vocab, b.flatKeys[size_t(i)], RecordKind::kPosition, dtype_);
    if (writes_) records.emplace_back(b.flatKeys[size_t(i)], record);
    b.pool[b.flatSlots[size_t(i)]] = std::move(record);
  }
  stats_.positionsComputed += n;
  if (writes_) insert(records, std::vector<int64_t>(records.size(), 1));
}

std::vector<Answer> TeacherCache::answerPrefix(const std::vector<std::vector<at::Tensor>>& requests,
                                               const ComputePositions& compute, const at::Device& device) {
  PrefixBatch b;
  lookupPositions(b, requests);
  computePositions(b, requests, compute);
  // Every position, hit or computed, is answered from its record's bytes:
  // each record decoded once, then gathered into the requests' rows.
  std::map<std::string, std::vector<at::Tensor>> decoded;
  for (const std::string& record : b.pool) {
    Answer a = decodeRow(record.data(), record.size());
    DISTILL_CHECK_T(IpcError, decoded.empty() || a.size() == decoded.size(),
                    "teacher cache: position records of different answers in one batch");
    for (auto& [name, t] : a) decoded[name].push_back(t);
  }
  std::vector<Answer> out(requests.size());
  for (auto& [name, list] : decoded) {
    DISTILL_CHECK_T(IpcError, list.size() == b.pool.size(), "teacher cache: a position record without '", name, "'");
    const at::Tensor all = at::cat(list, 0); // [positions, 1, ...]
    for (size_t q = 0; q < requests.size(); ++q) {
      std::vector<int64_t> shape = all.sizes().vec();
      shape[0] = requests[q].at(0).size(0);
      shape[1] = b.seq;
      out[q][name] = all.index_select(0, b.where[q]).view(shape).to(device);
    }
  }
  return out;
}

} // namespace distill
