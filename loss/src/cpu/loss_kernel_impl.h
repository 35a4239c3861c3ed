// The body of the fused CPU loss kernel (loss_kernel.h), included once per
// instruction set by loss_kernel_<isa>.cpp with DISTILL_LOSSK_NS set to that
// file's namespace. Everything but kernels() has internal linkage, and the file
// uses no std containers, so nothing compiled for AVX2 can be picked by the
// linker for code that runs on a CPU without it.
//
// The formulas are those of losses.cpp's ATen-op path (divergence(),
// teacherBuckets(), the gradient assembly); tests/loss checks the two
// against each other and against the Python reference. Sums over a row are
// accumulated in vector registers and flushed to double every kFlush vectors.

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "loss_kernel.h"
#include "loss_kernel_sampled.h"
#include "loss_kernel_vec.h"

namespace distill::lossk::DISTILL_LOSSK_NS {
namespace {

// What every row of a call shares: temperature, gradient scales.
template <typename T>
struct RowConsts {
  explicit RowConsts(const Args<T>& a)
      : temp(static_cast<T>(a.temperature)),
        t1(a.temperature == 1),
        ka(static_cast<T>(a.alpha * a.temperature / a.normalizer)), // d(T^2 kd)/dz = T d kd/ds
        cce(static_cast<T>((1 - a.alpha) / a.normalizer)),
        vt(temp) {}
  T temp;
  bool t1;
  T ka, cce;
  Vec<T> vt;
};

// One dense row's maxima and log-sum-exps (passes 1 and 2).
template <typename T>
struct DenseStats {
  T zmax, smax, tmax, ls1, lsS, lsT;
};

template <typename T>
DenseStats<T> denseStats(const Args<T>& a, const RowConsts<T>& k, const T* z, const T* t, int64_t n) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const T temp = k.temp;
  const bool t1 = k.t1;
  const Vec<T>& vt = k.vt;
  DenseStats<T> st;
  // Pass 1: maxima (of s = z / T too: division by T > 0 keeps the order).
  Vec<T> mz(-inf), mt(-inf);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    mz = at::vec::maximum(mz, load(z + j, c, -inf));
    if (t) mt = at::vec::maximum(mt, load(t + j, c, -inf));
  }
  st.zmax = hmax(mz);
  st.smax = t1 ? st.zmax : st.zmax / temp;
  st.tmax = t ? hmax(mt) / temp : T(0);
  // Pass 2: log-sum-exps, as log_softmax: x - max - log(sum exp(x - max)).
  const bool need1 = a.needCe || t1;
  Acc<T> s1, sS, sT;
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    const Vec<T> zv = load(z + j, c, -inf);
    if (need1) s1.add((zv - Vec<T>(st.zmax)).exp());
    if (t) {
      if (!t1) sS.add((zv / vt - Vec<T>(st.smax)).exp());
      sT.add((load(t + j, c, -inf) / vt - Vec<T>(st.tmax)).exp());
    }
  }
  st.ls1 = need1 ? static_cast<T>(std::log(static_cast<T>(s1.get()))) : T(0);
  st.lsS = t1 ? st.ls1 : static_cast<T>(std::log(static_cast<T>(sS.get())));
  st.lsT = t ? static_cast<T>(std::log(static_cast<T>(sT.get()))) : T(0);
  return st;
}

// Forward KL of one dense row (pass 3), its gradient into g when g is set.
template <typename T>
double denseForward(const Args<T>& a, const RowConsts<T>& k, const DenseStats<T>& st, const T* z, const T* t, T* g,
                    int64_t n) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const bool t1 = k.t1;
  const Vec<T>& vt = k.vt;
  auto p1Of = [&](const Vec<T>& zv) { return ((zv - Vec<T>(st.zmax)) - Vec<T>(st.ls1)).exp(); };
  Acc<T> kd;
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    const Vec<T> zv = load(z + j, c, -inf);
    const Vec<T> lp = ((t1 ? zv : zv / vt) - Vec<T>(st.smax)) - Vec<T>(st.lsS);
    const Vec<T> lq = (load(t + j, c, -inf) / vt - Vec<T>(st.tmax)) - Vec<T>(st.lsT);
    const Vec<T> q = lq.exp();
    kd.add(zeroWhere((lq - lp) * q, q));
    if (g) {
      const Vec<T> p = lp.exp();
      Vec<T> out = (p - q) * Vec<T>(k.ka);
      if (a.needCe) out = out + (t1 ? p : p1Of(zv)) * Vec<T>(k.cce);
      store(out, g + j, c);
    }
  }
  return kd.get();
}

// Reverse KL or JSD of one dense row: they need the row's divergence inside
// their gradient, so pass 3 keeps log p - log q (or log p - log M) in the
// gradient row and p in scratch, and pass 4 writes the gradient.
template <typename T>
double denseReverseOrJsd(const Args<T>& a, const RowConsts<T>& k, const DenseStats<T>& st, const T* z, const T* t, T* g,
                         T* scratch, int64_t n) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const bool t1 = k.t1;
  const Vec<T>& vt = k.vt;
  auto p1Of = [&](const Vec<T>& zv) { return ((zv - Vec<T>(st.zmax)) - Vec<T>(st.ls1)).exp(); };
  const bool jsd = a.kind == Kind::kJsd;
  const Vec<T> logBeta(static_cast<T>(std::log(a.beta))), logBeta1(static_cast<T>(std::log1p(-a.beta)));
  const Vec<T> floor(static_cast<T>(kLogFloor));
  Acc<T> k1, k2; // reverse: KL(p || q); jsd: KL(q || M), KL(p || M)
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    const Vec<T> zv = load(z + j, c, -inf);
    Vec<T> lp = ((t1 ? zv : zv / vt) - Vec<T>(st.smax)) - Vec<T>(st.lsS);
    Vec<T> lq = (load(t + j, c, -inf) / vt - Vec<T>(st.tmax)) - Vec<T>(st.lsT);
    Vec<T> d, p;
    if (jsd) {
      lq = at::vec::maximum(lq, floor);
      lp = at::vec::maximum(lp, floor);
      const Vec<T> logm = logaddexp(lq + logBeta, lp + logBeta1);
      p = lp.exp();
      k1.add((lq - logm) * lq.exp());
      d = lp - logm;
      k2.add(d * p);
    } else {
      p = lp.exp();
      d = lp - lq;
      k1.add(zeroWhere(d * p, p));
    }
    if (g) {
      store(d, g + j, c);
      store(p, scratch + j, c);
    }
  }
  const double kl = jsd ? k2.get() : k1.get();
  if (g) {
    const Vec<T> klv(static_cast<T>(kl)), b1(static_cast<T>(1 - a.beta));
    for (int64_t j = 0; j < n; j += W) {
      const int64_t c = std::min(W, n - j);
      const Vec<T> p = load(scratch + j, c, T(0));
      const Vec<T> dk = load(g + j, c, T(0)) - klv;
      Vec<T> out = (jsd ? dk * p * b1 : zeroWhere(dk * p, p)) * Vec<T>(k.ka);
      if (a.needCe) out = out + (t1 ? p : p1Of(load(z + j, c, -inf))) * Vec<T>(k.cce);
      store(out, g + j, c);
    }
  }
  return jsd ? a.beta * k1.get() + (1 - a.beta) * kl : kl;
}

// Dense teacher logits. Per row: pass 1 the maxima, pass 2 the sums of exp,
// pass 3 the divergence and (forward KL) the gradient; reverse KL and JSD a
// pass 4 for the gradient (denseReverseOrJsd).
template <typename T>
void denseRows(const Args<T>& a, int64_t begin, int64_t end, T* scratch) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t n = a.v;
  const RowConsts<T> k(a);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = a.rows[i];
    const T* z = a.z + r * n;
    const T* t = a.needKd ? a.t + (a.tRows ? a.tRows[i] : i) * n : nullptr;
    T* g = a.grad != nullptr ? a.grad + r * n : nullptr;
    const DenseStats<T> st = denseStats(a, k, z, t, n);
    if (a.needCe) a.ceRow[i] = -static_cast<double>((z[a.labels[r]] - st.zmax) - st.ls1);
    if (!t) { // CE only: p at temperature 1 (the CE's softmax)
      if (g) {
        for (int64_t j = 0; j < n; j += W) {
          const int64_t c = std::min(W, n - j);
          store(((load(z + j, c, -inf) - Vec<T>(st.zmax)) - Vec<T>(st.ls1)).exp() * Vec<T>(k.cce), g + j, c);
        }
      }
    } else if (a.kind == Kind::kForward) {
      a.kdRow[i] = denseForward(a, k, st, z, t, g, n);
    } else {
      a.kdRow[i] = denseReverseOrJsd(a, k, st, z, t, g, scratch, n);
    }
    if (g && a.needCe) g[a.labels[r]] -= k.cce;
  }
}

// A top-k row's student side: the log-sum-exp of the whole row and of its tail
// (the masked row) at T, and at temperature 1 for the CE.
template <typename T>
struct TopkStudent {
  T lseTail, lseS, lse1;
};

// One exp per token serves both sums, shifted by the row's max, as long as the
// tail's terms stay normal numbers (exact to rounding however small the tail
// is); a tail further below, a pass of its own with its own max. Leaves
// tmp[b] = the top-k logits at T and `mask` all zeros.
template <typename T>
TopkStudent<T> topkStudent(const Args<T>& a, const RowConsts<T>& kc, const T* z, const int64_t* idx, const T* zK,
                           T* mask, T* tmp) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t n = a.v, k = a.k;
  const T temp = kc.temp;
  const bool t1 = kc.t1;
  const Vec<T>& vt = kc.vt;
  TopkStudent<T> out{-inf, -inf, 0};
  if (!a.needKd) {
    T zmax, ls1;
    logsumexpParts(z, n, zmax, ls1);
    out.lse1 = zmax + ls1;
    return out;
  }
  for (int64_t b = 0; b < k; ++b) mask[idx[b]] = -inf;
  Vec<T> mt(-inf), mz(-inf);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    const Vec<T> zv = load(z + j, c, -inf);
    mt = at::vec::maximum(mt, zv + load(mask + j, c, T(0)));
    mz = at::vec::maximum(mz, zv);
  }
  const T tailMax = hmax(mt), zmax = hmax(mz);
  const T smax = t1 ? zmax : zmax / temp, tailMaxS = t1 ? tailMax : tailMax / temp;
  const bool shared = tailMax == -inf || tailMaxS - smax > T(-60);
  Acc<T> sAll, sTail, s1;
  for (int64_t j = 0; j < n; j += W) {
    const int64_t c = std::min(W, n - j);
    const Vec<T> zv = load(z + j, c, -inf);
    const Vec<T> e = ((t1 ? zv : zv / vt) - Vec<T>(smax)).exp();
    sAll.add(e);
    if (shared) sTail.add(Vec<T>::blendv(e, Vec<T>(T(0)), load(mask + j, c, T(0)) == Vec<T>(-inf)));
    if (a.needCe && !t1) s1.add((zv - Vec<T>(zmax)).exp());
  }
  out.lseS = smax + static_cast<T>(std::log(static_cast<T>(sAll.get())));
  if (tailMax != -inf) {
    if (shared) {
      out.lseTail = smax + static_cast<T>(std::log(static_cast<T>(sTail.get())));
    } else {
      Acc<T> st;
      for (int64_t j = 0; j < n; j += W) {
        const int64_t c = std::min(W, n - j);
        const Vec<T> zv = load(z + j, c, -inf);
        st.add((((t1 ? zv : zv / vt) + load(mask + j, c, T(0))) - Vec<T>(tailMaxS)).exp());
      }
      out.lseTail = tailMaxS + static_cast<T>(std::log(static_cast<T>(st.get())));
    }
  }
  if (a.needCe) out.lse1 = t1 ? out.lseS : zmax + static_cast<T>(std::log(static_cast<T>(s1.get())));
  for (int64_t b = 0; b < k; ++b) {
    mask[idx[b]] = 0;
    tmp[b] = t1 ? zK[b] : zK[b] / temp;
  }
  return out;
}

// The teacher's k+1 bucket log-probabilities of row r into lq (teacherBuckets()
// in loss_inputs.cpp / losses.cpp does the same with ATen ops).
template <typename T>
void topkTeacherBuckets(const Args<T>& a, int64_t r, T lseTail, T temp, T* lq) {
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t n = a.v, k = a.k;
  const T* vals = a.vals + r * k;
  for (int64_t b = 0; b < k; ++b) lq[b] = vals[b] / temp;
  if (!a.tLse && !a.tLogTail) {
    T m, ls;
    logsumexpParts(lq, k, m, ls);
    for (int64_t b = 0; b < k; ++b) lq[b] = (lq[b] - m) - ls;
    lq[k] = -inf;
  } else if (a.tLogTail) {
    const T logSum = a.tLogSum[r];
    for (int64_t b = 0; b < k; ++b) lq[b] -= logSum;
    lq[k] = a.tLogTail[r] - logSum;
  } else {
    const T lse = a.tLse[r];
    const T lseK = a.tLogSum[r] - lse;
    T logqTail;
    if (k == n) {
      logqTail = -inf;
    } else {
      const T x = std::min(lseK, T(0));
      logqTail = x > -static_cast<T>(std::log(2.0)) ? std::log(-std::expm1(x)) : std::log1p(-std::exp(x));
      const T logR = std::log(std::max(std::abs(lse), T(1)) * static_cast<T>(4 * a.eps));
      if (logqTail < logR) logqTail = lseTail == -inf ? -inf : logR;
    }
    const T norm = logaddexp(lseK, logqTail);
    for (int64_t b = 0; b < k; ++b) lq[b] -= lse + norm;
    lq[k] = logqTail - norm;
  }
}

// A top-k row's gradient: tail tokens (p_j / P_tail) * gb[k] (the softmax of
// the tail logits), the top-k tokens gb[b], plus the CE's p1 - onehot.
template <typename T>
void topkGrad(const Args<T>& a, const RowConsts<T>& kc, const TopkStudent<T>& st, int64_t r, const T* z,
              const int64_t* idx, const T* zK, const T* gb, T* tmp, T* g) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t n = a.v, k = a.k;
  const bool t1 = kc.t1;
  const T ka = kc.ka, cce = kc.cce;
  const T lseTail = st.lseTail, lse1 = st.lse1;
  const T gTail = a.needKd ? gb[k] * ka : T(0);
  if (a.needKd && t1 && lseTail != -inf) {
    // One exp: exp(z - lse1) = exp(z - lseTail) * P_tail.
    const Vec<T> f(gTail + (a.needCe ? cce * std::exp(lseTail - lse1) : T(0)));
    for (int64_t j = 0; j < n; j += W) {
      const int64_t c = std::min(W, n - j);
      store((load(z + j, c, -inf) - Vec<T>(lseTail)).exp() * f, g + j, c);
    }
  } else {
    const T shift = lseTail == -inf ? T(0) : lseTail;
    for (int64_t j = 0; j < n; j += W) {
      const int64_t c = std::min(W, n - j);
      const Vec<T> zv = load(z + j, c, -inf);
      Vec<T> out(T(0));
      if (a.needKd && lseTail != -inf) out = ((t1 ? zv : zv / kc.vt) - Vec<T>(shift)).exp() * Vec<T>(gTail);
      if (a.needCe) out = out + (zv - Vec<T>(lse1)).exp() * Vec<T>(cce);
      store(out, g + j, c);
    }
  }
  if (a.needKd) {
    for (int64_t b = 0; b < k; b += W) {
      const int64_t c = std::min(W, k - b);
      Vec<T> out = load(gb + b, c, T(0)) * Vec<T>(ka);
      if (a.needCe) out = out + (load(zK + b, c, -inf) - Vec<T>(lse1)).exp() * Vec<T>(cce);
      store(out, tmp + b, c);
    }
    for (int64_t b = 0; b < k; ++b) g[idx[b]] = tmp[b];
  }
  if (a.needCe) g[a.labels[r]] -= cce;
}

// Top-k teacher: the divergence over k+1 buckets (losses.h, "Top-k"). Per row:
// the top-k columns are masked with -inf in scratch (reset after the row), so
// the student's tail log-sum-exp is taken over the tail logits themselves
// (never as a difference); the k+1 buckets are small arrays; one last pass
// writes the gradient.
template <typename T>
void topkRows(const Args<T>& a, int64_t begin, int64_t end, T* scratch) {
  constexpr int64_t W = Vec<T>::size();
  const int64_t n = a.v, k = a.k;
  const RowConsts<T> kc(a);
  const bool needGrad = a.grad != nullptr;
  // Scratch: the mask row, then arrays of k+1 (rounded up to whole vectors).
  T* mask = scratch;
  const int64_t ka1 = (k + 1 + W - 1) / W * W;
  T* zK = mask + n; // student logits at the top-k
  T* lp = zK + ka1; // student bucket log-probabilities
  T* lq = lp + ka1; // teacher bucket log-probabilities
  T* gb = lq + ka1; // d kd / d s per bucket
  T* tmp = gb + ka1;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = a.rows[i];
    const T* z = a.z + r * n;
    const int64_t* idx = a.idx + r * k;
    T* g = needGrad ? a.grad + r * n : nullptr;
    for (int64_t b = 0; b < k; ++b) zK[b] = z[idx[b]];
    const TopkStudent<T> st = topkStudent(a, kc, z, idx, zK, mask, tmp);
    if (a.needCe) a.ceRow[i] = static_cast<double>(st.lse1 - z[a.labels[r]]);
    if (a.needKd) {
      for (int64_t b = 0; b < k; ++b) lp[b] = tmp[b] - st.lseS; // student buckets
      lp[k] = st.lseTail - st.lseS;
      topkTeacherBuckets(a, r, st.lseTail, kc.temp, lq);
      a.kdRow[i] = divergenceArrays(a.kind, a.beta, lq, lp, k + 1, needGrad ? gb : nullptr);
    }
    if (g) topkGrad(a, kc, st, r, z, idx, zK, gb, tmp, g);
  }
}

template <typename T>
void rowLogsumexp(const T* x, int64_t n, int64_t k, double temperature, T* out) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  const T temp = static_cast<T>(temperature);
  const Vec<T> vt(temp);
  for (int64_t r = 0; r < n; ++r) {
    const T* row = x + r * k;
    Vec<T> mx(-inf);
    for (int64_t j = 0; j < k; j += W) mx = at::vec::maximum(mx, load(row + j, std::min(W, k - j), -inf));
    const T m = hmax(mx) / temp;
    if (m == -inf || m == inf || std::isnan(m)) {
      out[r] = m;
      continue;
    }
    Acc<T> s;
    for (int64_t j = 0; j < k; j += W) s.add((load(row + j, std::min(W, k - j), -inf) / vt - Vec<T>(m)).exp());
    out[r] = m + static_cast<T>(std::log(static_cast<T>(s.get())));
  }
}

const Kernels kTable{&denseRows<float>,    &denseRows<double>,    &topkRows<float>,
                     &topkRows<double>,     &sampledRows<float>,   &sampledRows<double>,
                     &rowLogsumexp<float>,  &rowLogsumexp<double>};

} // namespace

const Kernels* kernels() { return &kTable; }

} // namespace distill::lossk::DISTILL_LOSSK_NS
