// The sampled shaper (answer.h): K draws per position by inverse CDF at
// counter-based uniforms, so that an answer is a function of the logits, the
// run's seed, the request and the position alone (no generator state: the
// same request answered twice, in any batch, draws the same ids).
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "answer.h"
#include "distill/core/errors.h"

namespace distill {
namespace {

// splitmix64's finaliser: a bijection of 64-bit words whose outputs pass as independent.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// [B * P, K] uniforms in [0, 1): draw j of position p of row b from mix(key_b, p, j).
at::Tensor uniforms(const at::Tensor& rowKeys, int64_t positions, int64_t k) {
  const int64_t rows = rowKeys.numel();
  at::Tensor u = at::empty({rows * positions, k}, at::kDouble);
  double* up = u.data_ptr<double>();
  const at::Tensor keys = rowKeys.to(at::kLong).contiguous();
  const int64_t* kp = keys.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t p = 0; p < positions; ++p) {
      const uint64_t base = mix(static_cast<uint64_t>(kp[b]) ^ mix(static_cast<uint64_t>(p)));
      for (int64_t j = 0; j < k; ++j) {
        *up++ = double(mix(base + static_cast<uint64_t>(j)) >> 11) * 0x1p-53;
      }
    }
  }
  return u;
}

// Each row's sorted draws [M, K] as unique ids and their counts, padded with
// the row's first id and count 0.
std::pair<at::Tensor, at::Tensor> uniqueCounts(const at::Tensor& sorted) {
  const int64_t m = sorted.size(0), k = sorted.size(1);
  at::Tensor s = sorted.to(at::kLong).cpu().contiguous();
  at::Tensor ids = at::empty({m, k}, at::kInt), counts = at::zeros({m, k}, at::kShort);
  const int64_t* sp = s.data_ptr<int64_t>();
  int32_t* ip = ids.data_ptr<int32_t>();
  int16_t* cp = counts.data_ptr<int16_t>();
  for (int64_t r = 0; r < m; ++r) {
    const int64_t* row = sp + r * k;
    int64_t u = 0;
    for (int64_t j = 0; j < k; ++j) {
      if (j > 0 && row[j] == row[j - 1]) {
        ++cp[r * k + u - 1];
      } else {
        ip[r * k + u] = static_cast<int32_t>(row[j]);
        cp[r * k + u++] = 1;
      }
    }
    for (; u < k; ++u) ip[r * k + u] = static_cast<int32_t>(row[0]);
  }
  return {ids, counts};
}

} // namespace

uint64_t sampleKey(int64_t seed, int student, const Tag& tag, int64_t row) {
  uint64_t h = mix(static_cast<uint64_t>(seed));
  for (uint64_t part : {static_cast<uint64_t>(student), static_cast<uint64_t>(tag.step),
                        static_cast<uint64_t>(tag.accStep), tag.seq, static_cast<uint64_t>(row)}) {
    h = mix(h ^ part);
  }
  return h;
}

uint64_t positionSampleKey(uint64_t rowKey, int64_t position) {
  // uniforms() draws position p of key k from mix(k ^ mix(p)): this key at position 0 is rowKey at `position`.
  return rowKey ^ mix(static_cast<uint64_t>(position)) ^ mix(0);
}

Answer shapeSampled(const at::Tensor& logits, const ShapeContext& c) {
  const int64_t k = c.teacher.samples;
  DISTILL_CHECK_T(ConfigError, k >= 1 && k <= 32767, "teacher.samples must be in [1, 32767] (int16 counts), found ", k);
  DISTILL_CHECK_T(InternalError, logits.dim() >= 2 && c.rowKeys.defined() && c.rowKeys.numel() == logits.size(0),
                  "sampled answers need one key per row of the teacher's output ", logits.sizes());
  const int64_t v = logits.size(-1), rows = logits.size(0), positions = logits.numel() / (v * rows);
  const int64_t m = rows * positions;
  at::Tensor flat = logits.reshape({m, v});
  at::Tensor u = uniforms(c.rowKeys, positions, k).to(logits.device());
  at::Tensor draws = at::empty({m, k}, u.options().dtype(at::kLong));
  // The CDF in float64 (float32's rounding would move the draws of a 128k
  // vocabulary's small ids), ~2^24 elements at a time.
  const int64_t chunk = std::max<int64_t>(1, (int64_t(1) << 24) / v);
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t n = std::min(chunk, m - r0);
    at::Tensor cdf = at::softmax(flat.narrow(0, r0, n).to(at::kDouble).div(c.temperature), 1).cumsum_(1);
    at::Tensor ur = u.narrow(0, r0, n).mul(cdf.narrow(1, v - 1, 1));
    // The first id whose CDF exceeds u: an id of probability 0 is never drawn.
    draws.narrow(0, r0, n).copy_(at::searchsorted(cdf, ur, /*out_int32=*/false, /*right=*/true).clamp_max_(v - 1));
  }
  auto [ids, counts] = uniqueCounts(std::get<0>(draws.sort(1)));
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  shape.push_back(k);
  return {{protocol::kSampledIds, ids.reshape(shape).to(logits.device())},
          {protocol::kSampledCounts, counts.reshape(shape).to(logits.device())}};
}

} // namespace distill
