// The fused CPU kernel of the losses whose teacher is a few ids per token
// (loss_kernel.h: sampledF/D): sampled targets (forward KL against the
// estimate counts / K) and loss.kind sampled_token (the per-token reverse-KL
// estimate as a policy-gradient advantage). Included by loss_kernel_impl.h,
// within its per-instruction-set namespace DISTILL_LOSSK_NS.
//
// The formulas are sampled_chunks.cpp's (its ATen ops are the reference in
// tests/loss/signals_kernel_test.cpp). Per row, three passes over the
// student's logits: the max, the sums of exp (at T, and at 1 for the CE when
// T != 1), and the gradient, written once; the K ids are read and scattered
// as plain loops. No [C, V] temporary.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "loss_kernel.h"
#include "loss_kernel_vec.h"

namespace distill::lossk::DISTILL_LOSSK_NS {
namespace {

// One row's student side: the max of z and of s = z / T, log sum exp(s - smax)
// and the log-sum-exps at T and at 1 (the CE's).
template <typename T>
struct SampledStudent {
  T smax, logSumS, lseS, zmax, logSum1, lse1;
};

template <typename T>
SampledStudent<T> sampledStudent(const T* z, int64_t n, T temp, bool needT1) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const bool t1 = temp == T(1);
  const Vec<T> vt(temp);
  Vec<T> mz(-inf);
  for (int64_t j = 0; j < n; j += W) mz = at::vec::maximum(mz, load(z + j, std::min(W, n - j), -inf));
  SampledStudent<T> st;
  st.zmax = hmax(mz);
  st.smax = t1 ? st.zmax : st.zmax / temp; // max(z / T) = max(z) / T for T > 0, bit for bit
  Acc<T> sS, s1;
  for (int64_t j = 0; j < n; j += W) {
    const Vec<T> zv = load(z + j, std::min(W, n - j), -inf);
    sS.add(((t1 ? zv : zv / vt) - Vec<T>(st.smax)).exp());
    if (needT1 && !t1) s1.add((zv - Vec<T>(st.zmax)).exp());
  }
  st.logSumS = static_cast<T>(std::log(static_cast<T>(sS.get())));
  st.lseS = st.smax + st.logSumS;
  st.logSum1 = t1 ? st.logSumS : needT1 ? static_cast<T>(std::log(static_cast<T>(s1.get()))) : T(0);
  st.lse1 = st.zmax + st.logSum1;
  return st;
}

// Writes g = cp * p + cce * p1 over the row (p = softmax(z / T), p1 = softmax(z)).
template <typename T>
void sampledDenseGrad(const T* z, T* g, int64_t n, T temp, const SampledStudent<T>& st, T cp, T cce) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const bool t1 = temp == T(1);
  const Vec<T> vt(temp), smax(st.smax), lsS(st.logSumS), zmax(st.zmax), ls1(st.logSum1);
  if (t1 || cce == T(0)) {
    const Vec<T> f(t1 ? cp + cce : cp); // p1 = p at T = 1
    for (int64_t j = 0; j < n; j += W) {
      const int64_t c = std::min(W, n - j);
      const Vec<T> zv = load(z + j, c, -inf);
      store((((t1 ? zv : zv / vt) - smax) - lsS).exp() * f, g + j, c);
    }
    return;
  }
  const Vec<T> fp(cp), f1(cce);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    const Vec<T> zv = load(z + j, c, -inf);
    Vec<T> out = (((zv / vt) - smax) - lsS).exp() * fp;
    out = out + ((zv - zmax) - ls1).exp() * f1;
    store(out, g + j, c);
  }
}

// The row's kd, and the coefficient of p in d kd / d s (1 for sampled targets;
// -d for sampled_token, whose onehot part is added by the caller).
template <typename T>
struct SampledKd {
  double kd;
  T cp, atId; // atId: d kd / d s at the sampled id beyond cp * p (sampled_token)
};

template <typename T>
SampledKd<T> sampledKd(const Args<T>& a, int64_t r, const T* z, T temp, const SampledStudent<T>& st) {
  const bool t1 = temp == T(1);
  const int64_t k = a.k;
  const int64_t* idx = a.idx + r * k;
  if (a.w) { // kd = -sum_j w_j log p_j over the drawn ids (padding w = 0 adds 0)
    const T* w = a.w + r * k;
    double kd = 0;
    for (int64_t b = 0; b < k; ++b) {
      if (w[b] == T(0)) continue;
      const T s = t1 ? z[idx[b]] : z[idx[b]] / temp;
      kd -= static_cast<double>(static_cast<T>(s - st.lseS) * w[b]);
    }
    return {kd, T(1), T(0)};
  }
  // sampled_token: d = log p_S(x) - log p_T(x), times the truncated importance weight.
  const T logPx = (t1 ? z[idx[0]] : z[idx[0]] / temp) - st.lseS;
  T d = logPx - a.logq[r];
  if (a.sampleLogp) d *= std::min(static_cast<T>(std::exp(logPx - a.sampleLogp[r])), static_cast<T>(a.ratioMax));
  return {static_cast<double>(d), -d, d};
}

// Sampled targets or sampled_token, rows [begin, end) of the chunk.
template <typename T>
void sampledRows(const Args<T>& a, int64_t begin, int64_t end, T* /*scratch*/) {
  const int64_t n = a.v, k = a.k;
  const T temp = static_cast<T>(a.temperature);
  const T ka = static_cast<T>(a.alpha * a.temperature / a.normalizer); // d(T^2 kd)/dz = T d kd/ds
  const T cce = a.needCe ? static_cast<T>((1 - a.alpha) / a.normalizer) : T(0);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = a.rows[i];
    const T* z = a.z + r * n;
    T* g = a.grad != nullptr ? a.grad + r * n : nullptr;
    // Without the divergence the CE's softmax at 1 is the only one needed.
    const SampledStudent<T> st = sampledStudent(z, n, a.needKd ? temp : T(1), a.needCe);
    if (a.needCe) a.ceRow[i] = static_cast<double>(st.lse1 - z[a.labels[r]]);
    SampledKd<T> kd{0, T(0), T(0)};
    if (a.needKd) {
      kd = sampledKd(a, r, z, temp, st);
      a.kdRow[i] = kd.kd;
    }
    if (!g) continue;
    // Every read of z is done: g may be z's row.
    sampledDenseGrad(z, g, n, a.needKd ? temp : T(1), st, kd.cp * ka, cce);
    if (a.needKd) {
      const int64_t* idx = a.idx + r * k;
      if (a.w) {
        const T* w = a.w + r * k;
        for (int64_t b = 0; b < k; ++b) g[idx[b]] -= w[b] * ka; // repeated ids add up
      } else {
        g[idx[0]] += kd.atId * ka;
      }
    }
    if (a.needCe) g[a.labels[r]] -= cce;
  }
}

} // namespace
} // namespace distill::lossk::DISTILL_LOSSK_NS
