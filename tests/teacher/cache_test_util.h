#pragma once

// What teacher_cache_test's sources share: a deterministic teacher and its
// shaped answers, bit-equality of tensors and answers, a store's options.

#include <torch/torch.h>

#include <cstring>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache_store_dir.h"
#include "distill/core/answer_kinds.h"
#include "distill/teacher/server.h"

namespace cache_testing {

using distill::Answer;
using distill::TeacherCache;

inline const std::vector<std::string> kNames = {"input_ids"};
inline const std::string kContext = "test context";

using TempDir = distill::testing::CacheStoreDir;

inline at::Tensor ids(int64_t rows, int64_t seq, uint64_t seed, int64_t vocab = 64) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, vocab, {rows, seq}, g, at::kLong);
}

// A deterministic teacher: logits [rows, seq, vocab] from a fixed table.
inline at::Tensor tableLogits(const at::Tensor& x, int64_t vocab) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(4242);
  at::Tensor table = at::randn({64, vocab}, g, at::kFloat) * 3;
  return table.index_select(0, x.reshape(-1)).view({x.size(0), x.size(1), vocab});
}

// Its answer as the server shapes it (top-k k, or full logits with k = 0).
inline TeacherCache::Computed shaped(const at::Tensor& x, int64_t k, int64_t vocab = 64) {
  at::Tensor logits = tableLogits(x, vocab);
  if (k == 0) return {{{distill::protocol::kLogits, logits}}, vocab};
  return {distill::topkOutput(logits, k, 2.0), vocab};
}

inline bool bitEqual(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.contiguous().cpu(), y = b.contiguous().cpu();
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
      std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

inline bool bitEqual(const Answer& a, const Answer& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !bitEqual(t, it->second)) return false;
  }
  return true;
}

// Float32 full logits as the store keeps them: through float16.
inline at::Tensor asStored(const at::Tensor& logits) { return logits.to(at::kHalf).to(at::kFloat); }

inline Answer rowOf(const Answer& a, int64_t r) {
  Answer out;
  for (const auto& [name, t] : a) out[name] = t.narrow(0, r, 1);
  return out;
}

inline distill::TeacherOptions::CacheOptions options(const std::string& path, const std::string& mode,
                                              int64_t maxBytes = int64_t(64) << 20) {
  distill::TeacherOptions::CacheOptions o;
  o.path = path;
  o.mode = *distill::parseEnum<distill::CacheMode>(mode);
  o.max_bytes = maxBytes;
  return o;
}

} // namespace cache_testing
