// The teacher-output cache answering rows (cache.h): every row looked up by
// its key, the missing rows of every request computed in one forward, stored,
// and every row answered from its record's bytes. Prefix keys: prefix.cpp; the
// LMDB store: store.cpp.
#include "cache.h"

namespace distill {

std::vector<at::Tensor> gatherRows(const std::vector<std::vector<at::Tensor>>& requests,
                                   const std::vector<std::pair<size_t, int64_t>>& rows) {
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < requests.at(rows.at(0).first).size(); ++i) {
    std::vector<at::Tensor> parts;
    for (size_t m = 0; m < rows.size();) {
      size_t end = m + 1;
      while (end < rows.size() && rows[end].first == rows[m].first && rows[end].second == rows[end - 1].second + 1) {
        ++end;
      }
      parts.push_back(requests[rows[m].first][i].narrow(0, rows[m].second, int64_t(end - m)));
      m = end;
    }
    inputs.push_back(parts.size() == 1 ? parts[0] : at::cat(parts, 0));
  }
  return inputs;
}

TeacherCache::Computed TeacherCache::computeRows(const std::vector<std::vector<at::Tensor>>& requests,
                                                 const std::vector<std::pair<size_t, int64_t>>& rows,
                                                 const at::Tensor& positions, const ComputePositions& compute) {
  computing_ = rows;
  struct Clear {
    std::vector<std::pair<size_t, int64_t>>& v;
    ~Clear() { v.clear(); } // also when compute throws
  } clear{computing_};
  Computed computed = compute(gatherRows(requests, rows), positions);
  ++stats_.forwards;
  return computed;
}

std::vector<Answer> TeacherCache::answer(const std::vector<std::vector<at::Tensor>>& requests, const Compute& compute,
                                         const at::Device& device) {
  // Every position shaped, then the wanted ones taken (tests; the server shapes only those).
  auto withPositions = [&](const std::vector<at::Tensor>& inputs, const at::Tensor& positions) {
    Computed c = compute(inputs);
    if (positions.defined()) c.answer = gatherPositions(c.answer, {}, positions, inputs.at(0).size(1));
    return c;
  };
  return answer(requests, ComputePositions(withPositions), device);
}

std::vector<Answer> TeacherCache::answer(const std::vector<std::vector<at::Tensor>>& requests,
                                         const ComputePositions& compute, const at::Device& device) {
  return keys_ == CacheKeys::kPrefix ? answerPrefix(requests, compute, device) : answerRows(requests, compute, device);
}

std::vector<Answer> TeacherCache::answerRows(const std::vector<std::vector<at::Tensor>>& requests,
                                             const ComputePositions& compute, const at::Device& device) {
  struct Row {
    size_t request;
    int64_t row;
    CacheKey key;
    int64_t tokens;
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
        ++stats_.lookups;
        if (auto record = lookup(key)) {
          records[q][size_t(r)] = std::move(*record);
          ++stats_.hits;
          stats_.hitTokens += tokensPerRow;
          continue;
        }
      }
      missing.push_back({q, r, key, tokensPerRow});
    }
  }
  if (!missing.empty()) {
    // Every missing row of every request in one forward.
    std::vector<std::pair<size_t, int64_t>> where;
    for (const Row& m : missing) where.emplace_back(m.request, m.row);
    Computed computed = computeRows(requests, where, at::Tensor(), compute);
    if (dtype_ == CacheDtype::kFloat16) roundForStorage(computed.answer, temperature_);
    std::vector<std::pair<CacheKey, std::string>> rows;
    std::vector<int64_t> tokens;
    Answer host;
    for (auto& [name, t] : computed.answer) host[name] = t.cpu();
    for (size_t m = 0; m < missing.size(); ++m) {
      Answer row;
      for (auto& [name, t] : host) row[name] = t.narrow(0, int64_t(m), 1);
      std::string record = encodeRow(row, computed.vocab, missing[m].key, RecordKind::kRow, dtype_);
      if (writes_) rows.emplace_back(missing[m].key, record), tokens.push_back(missing[m].tokens);
      records[missing[m].request][size_t(missing[m].row)] = std::move(record);
    }
    if (writes_) insert(rows, tokens);
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
