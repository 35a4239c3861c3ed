// The fused CPU loss kernel's vector helpers (loads and stores of partial
// vectors, horizontal max and sum, accumulators, logaddexp, the divergence of
// two small arrays), included by loss_kernel_impl.h within its per-instruction
// set namespace DISTILL_LOSSK_NS (see there).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "loss_kernel.h"

namespace distill::lossk::DISTILL_LOSSK_NS {
namespace {

template <typename T>
using Vec = at::vec::Vectorized<T>;

constexpr int kFlush = 64;

// `count` elements of p, the other lanes `pad`.
template <typename T>
inline Vec<T> load(const T* p, int64_t count, T pad) {
  if (count == Vec<T>::size()) return Vec<T>::loadu(p);
  const Vec<T> lane = Vec<T>::arange(T(0), T(1));
  return Vec<T>::blendv(Vec<T>(pad), Vec<T>::loadu(p, count), lane < Vec<T>(static_cast<T>(count)));
}

template <typename T>
inline void store(const Vec<T>& x, T* p, int64_t count) {
  if (count == Vec<T>::size()) {
    x.store(p);
  } else {
    x.store(p, static_cast<int>(count));
  }
}

template <typename T>
inline T hmax(const Vec<T>& x) {
  return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return at::vec::maximum(a, b); }, x);
}

template <typename T>
inline T hsum(const Vec<T>& x) {
  return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return a + b; }, x);
}

// A sum of vectors, exact enough for a row of any length: lanes in T, flushed
// to a double every kFlush additions.
template <typename T>
struct Acc {
  Vec<T> acc = Vec<T>(T(0));
  int count = 0;
  double total = 0;
  void add(const Vec<T>& x) {
    acc = acc + x;
    if (++count == kFlush) flush();
  }
  void flush() {
    total += hsum(acc);
    acc = Vec<T>(T(0));
    count = 0;
  }
  double get() {
    flush();
    return total;
  }
};

template <typename T>
inline Vec<T> zeroWhere(const Vec<T>& x, const Vec<T>& w) { // 0 where w == 0, else x
  return Vec<T>::blendv(x, Vec<T>(T(0)), w == Vec<T>(T(0)));
}

// ATen's logaddexp, scalar and vector (callers keep both arguments finite in
// the vector form).
template <typename T>
inline T logaddexp(T a, T b) {
  if (std::isinf(a) && a == b) return a;
  const T m = std::max(a, b);
  return m + std::log1p(std::exp(-std::abs(a - b)));
}

template <typename T>
inline Vec<T> logaddexp(const Vec<T>& a, const Vec<T>& b) {
  return at::vec::maximum(a, b) + (Vec<T>(T(0)) - (a - b).abs()).exp().log1p();
}

constexpr double kLogFloor = -1e4; // as divergence() in losses.cpp: exp() of it is 0

// max and log(sum exp(x - max)) of x[0..m) (an empty or all -inf array: -inf, 0).
template <typename T>
inline void logsumexpParts(const T* x, int64_t m, T& max, T& logSum) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  Vec<T> mx(-inf);
  for (int64_t j = 0; j < m; j += W) mx = at::vec::maximum(mx, load(x + j, std::min(W, m - j), -inf));
  max = hmax(mx);
  if (max == -inf) {
    logSum = 0;
    return;
  }
  Acc<T> s;
  for (int64_t j = 0; j < m; j += W) s.add((load(x + j, std::min(W, m - j), -inf) - Vec<T>(max)).exp());
  logSum = static_cast<T>(std::log(static_cast<T>(s.get())));
}

// Divergence of two arrays of log-probabilities (the k+1 buckets of the top-k
// path), as losses.cpp's divergence(): returns the row's kd and, when gb is
// not null, writes d kd / d s per column into gb. Consumes lq and lp.
template <typename T>
double divergenceArrays(Kind kind, double beta, T* lq, T* lp, int64_t m, T* gb) {
  constexpr int64_t W = Vec<T>::size();
  const T inf = std::numeric_limits<T>::infinity();
  if (kind == Kind::kForward) {
    Acc<T> kd;
    for (int64_t j = 0; j < m; j += W) {
      const int64_t c = std::min(W, m - j);
      const Vec<T> q = load(lq + j, c, -inf).exp(), p = load(lp + j, c, -inf);
      kd.add(zeroWhere((load(lq + j, c, -inf) - p) * q, q));
      if (gb) store(p.exp() - q, gb + j, c);
    }
    return kd.get();
  }
  if (kind == Kind::kReverse) {
    Acc<T> kd;
    for (int64_t j = 0; j < m; j += W) {
      const int64_t c = std::min(W, m - j);
      const Vec<T> lpv = load(lp + j, c, -inf), p = lpv.exp();
      const Vec<T> d = lpv - load(lq + j, c, -inf);
      kd.add(zeroWhere(d * p, p));
      store(d, lp + j, c); // lp now holds log p - log q
      store(p, lq + j, c); // lq now holds p
    }
    const double kl = kd.get();
    if (gb) {
      for (int64_t j = 0; j < m; j += W) {
        const int64_t c = std::min(W, m - j);
        const Vec<T> p = load(lq + j, c, T(0));
        store(zeroWhere((load(lp + j, c, T(0)) - Vec<T>(static_cast<T>(kl))) * p, p), gb + j, c);
      }
    }
    return kl;
  }
  const Vec<T> logBeta(static_cast<T>(std::log(beta))), logBeta1(static_cast<T>(std::log1p(-beta)));
  const Vec<T> floor(static_cast<T>(kLogFloor));
  Acc<T> kq, kp;
  for (int64_t j = 0; j < m; j += W) {
    const int64_t c = std::min(W, m - j);
    const Vec<T> q_l = at::vec::maximum(load(lq + j, c, -inf), floor);
    const Vec<T> p_l = at::vec::maximum(load(lp + j, c, -inf), floor);
    const Vec<T> logm = logaddexp(q_l + logBeta, p_l + logBeta1);
    const Vec<T> q = q_l.exp(), p = p_l.exp();
    kq.add((q_l - logm) * q);
    const Vec<T> d = p_l - logm;
    kp.add(d * p);
    store(d, lp + j, c);
    store(p, lq + j, c);
  }
  const double kpv = kp.get();
  if (gb) {
    for (int64_t j = 0; j < m; j += W) {
      const int64_t c = std::min(W, m - j);
      const Vec<T> d = load(lp + j, c, T(0)), p = load(lq + j, c, T(0));
      store((d - Vec<T>(static_cast<T>(kpv))) * p * Vec<T>(static_cast<T>(1 - beta)), gb + j, c);
    }
  }
  return beta * kq.get() + (1 - beta) * kpv;
}

} // namespace
} // namespace distill::lossk::DISTILL_LOSSK_NS
