// The CUDA row kernel (loss_rows.h): one block of kThreads per row. Dense
// teacher: pass 1 online max/sum of exp of the student at T (and at 1 for the
// CE) and of the teacher at T; pass 2 the divergence (forward KL writes the
// gradient in the same pass); reverse KL and JSD need the row's divergence in
// their gradient, so a pass 3 writes it. Top-k teacher: the k ids are marked in
// a shared-memory bitmap of the vocabulary, so the student's tail log-sum-exp
// is summed over the tail logits themselves (never as a difference); the k+1
// buckets live in shared memory; one last pass writes the tail's gradient, then
// the k top tokens'. Every element of z is read before its gradient is written,
// by the same thread, so grad may alias z.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "loss_rows.h"

namespace distill::lossk::cuda {
namespace {

constexpr int kThreads = 512;
constexpr float kLogFloor = -1e4f; // as losses.cpp's divergence(): exp() of it is 0
constexpr float kInf = __builtin_huge_valf();

__device__ __forceinline__ float toF(float x) { return x; }
__device__ __forceinline__ float toF(__half x) { return __half2float(x); }
__device__ __forceinline__ float toF(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T fromF(float x);
template <>
__device__ __forceinline__ float fromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half fromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// A running max and sum of exp(x - max): log-sum-exp = m + log(s).
struct Lse {
  float m = -kInf, s = 0;
  __device__ void add(float x) {
    if (x == -kInf) return;
    if (x > m) {
      s = s * __expf(m - x) + 1.f; // m == -inf: s is 0, exp(-inf) 0
      m = x;
    } else {
      s += __expf(x - m);
    }
  }
  __device__ void merge(float om, float os) {
    if (om == -kInf) return;
    if (m == -kInf) {
      m = om, s = os;
      return;
    }
    const float mx = fmaxf(m, om);
    s = s * __expf(m - mx) + os * __expf(om - mx);
    m = mx;
  }
  __device__ float get() const { return m == -kInf ? -kInf : m + logf(s); }
};

// Block-wide reductions; every thread gets the result. `sh` holds 2 * 32 floats.
__device__ float blockSum(float x, float* sh) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads(); // sh may still be read by a previous reduction
  if (lane == 0) sh[w] = x;
  __syncthreads();
  x = lane < nw ? sh[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ float blockLse(Lse a, float* sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, a.m, o), os = __shfl_xor_sync(0xffffffffu, a.s, o);
    a.merge(om, os);
  }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[w] = a.m, sh[32 + w] = a.s;
  __syncthreads();
  Lse b;
  if (lane < nw) b.m = sh[lane], b.s = sh[32 + lane];
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, b.m, o), os = __shfl_xor_sync(0xffffffffu, b.s, o);
    b.merge(om, os);
  }
  return b.get();
}

__device__ __forceinline__ float logaddexpF(float a, float b) {
  if (a == b && (a == kInf || a == -kInf)) return a;
  const float mx = fmaxf(a, b);
  return mx + log1pf(__expf(-fabsf(a - b)));
}

// What every row of a launch shares.
struct Consts {
  float invT, ka, cce, logBeta, logBeta1;
  bool t1;
  __device__ explicit Consts(const RowArgs& a)
      : invT(1.f / a.temperature),
        ka(a.alpha * a.temperature / a.normalizer), // d(T^2 kd)/dz = T d kd/ds
        cce((1.f - a.alpha) / a.normalizer),
        logBeta(logf(a.beta)),
        logBeta1(log1pf(-a.beta)),
        t1(a.temperature == 1.f) {}
};

// A dense row's log-sum-exps: the student at T, at 1 (the CE), the teacher at T.
struct DenseLse {
  float s, one, t;
};

template <typename TZ, typename TT>
__device__ DenseLse denseLse(const RowArgs& a, const Consts& k, const TZ* z, const TT* t, float* sh) {
  Lse sS, s1, sT;
  const bool sep1 = a.needCe && !k.t1; // the CE's softmax at 1 apart from the KD's at T
  for (int64_t j = threadIdx.x; j < a.v; j += blockDim.x) {
    const float x = toF(z[j]);
    if (a.needKd || !sep1) sS.add(k.t1 ? x : x * k.invT);
    if (sep1) s1.add(x);
    if (t) sT.add(toF(t[j]) * k.invT);
  }
  DenseLse out;
  out.s = (a.needKd || !sep1) ? blockLse(sS, sh) : 0.f;
  out.one = sep1 ? blockLse(s1, sh) : out.s;
  out.t = t ? blockLse(sT, sh) : 0.f;
  return out;
}

// The CE's part of a token's gradient: cce (p1 - onehot).
__device__ __forceinline__ float ceGrad(float cce, float x, float lse1, bool isLabel) {
  return cce * (__expf(x - lse1) - (isLabel ? 1.f : 0.f));
}

// Pass 2: the divergence's sums (forward: KL(q||p); reverse: KL(p||q); jsd: KL(q||M), KL(p||M)),
// and for forward KL the gradient.
template <typename TZ, typename TT>
__device__ void denseDivergence(const RowArgs& a, const Consts& k, const DenseLse& l, const TZ* z, const TT* t, TZ* g,
                                int64_t label, float& k1, float& k2) {
  const bool fwd = a.kind == Kind::kForward, jsd = a.kind == Kind::kJsd;
  for (int64_t j = threadIdx.x; j < a.v; j += blockDim.x) {
    const float x = toF(z[j]);
    float lp = (k.t1 ? x : x * k.invT) - l.s;
    float lq = toF(t[j]) * k.invT - l.t;
    if (fwd) {
      const float q = __expf(lq);
      if (q > 0.f) k1 += q * (lq - lp);
      if (g) {
        float out = (__expf(lp) - q) * k.ka;
        if (a.needCe) out += ceGrad(k.cce, x, l.one, j == label);
        g[j] = fromF<TZ>(out);
      }
    } else if (jsd) {
      lq = fmaxf(lq, kLogFloor), lp = fmaxf(lp, kLogFloor);
      const float logm = logaddexpF(lq + k.logBeta, lp + k.logBeta1);
      k1 += (lq - logm) * __expf(lq);
      k2 += (lp - logm) * __expf(lp);
    } else {
      const float p = __expf(lp);
      if (p > 0.f) k1 += (lp - lq) * p;
    }
  }
}

// Pass 3 (reverse KL, JSD): the gradient p (log p/q - KL), (1-beta) p (log p/M - KL(p||M)).
template <typename TZ, typename TT>
__device__ void denseSecondGrad(const RowArgs& a, const Consts& k, const DenseLse& l, const TZ* z, const TT* t, TZ* g,
                                int64_t label, float kl) {
  const bool jsd = a.kind == Kind::kJsd;
  for (int64_t j = threadIdx.x; j < a.v; j += blockDim.x) {
    const float x = toF(z[j]);
    float lp = (k.t1 ? x : x * k.invT) - l.s;
    float lq = toF(t[j]) * k.invT - l.t;
    float out;
    if (jsd) {
      lq = fmaxf(lq, kLogFloor), lp = fmaxf(lp, kLogFloor);
      const float logm = logaddexpF(lq + k.logBeta, lp + k.logBeta1);
      out = (lp - logm - kl) * __expf(lp) * (1.f - a.beta);
    } else {
      const float p = __expf(lp);
      out = p > 0.f ? (lp - lq - kl) * p : 0.f;
    }
    out *= k.ka;
    if (a.needCe) out += ceGrad(k.cce, x, l.one, j == label);
    g[j] = fromF<TZ>(out);
  }
}

template <typename TZ, typename TT>
__global__ void __launch_bounds__(kThreads) denseRows(RowArgs a) {
  __shared__ float sh[64];
  const Consts k(a);
  const int64_t i = blockIdx.x, r = a.rows[i];
  const TZ* z = static_cast<const TZ*>(a.z) + r * a.zStride;
  TZ* g = a.grad ? static_cast<TZ*>(a.grad) + r * a.gStride : nullptr;
  const TT* t = a.needKd ? static_cast<const TT*>(a.t) + r * a.tStride : nullptr;
  const int64_t label = a.labels[r];
  const float zLabel = a.needCe ? toF(z[label]) : 0.f; // read before any write
  const DenseLse l = denseLse(a, k, z, t, sh);
  if (threadIdx.x == 0) {
    a.ceRow[i] = a.needCe ? l.one - zLabel : 0.f;
    if (!a.needKd) a.kdRow[i] = 0.f;
  }
  if (!t) { // CE only
    for (int64_t j = threadIdx.x; g && j < a.v; j += blockDim.x)
      g[j] = fromF<TZ>(ceGrad(k.cce, toF(z[j]), l.one, j == label));
    return;
  }
  float k1 = 0, k2 = 0;
  denseDivergence(a, k, l, z, t, g, label, k1, k2);
  const bool jsd = a.kind == Kind::kJsd;
  k1 = blockSum(k1, sh);
  if (jsd) k2 = blockSum(k2, sh);
  if (threadIdx.x == 0) a.kdRow[i] = jsd ? a.beta * k1 + (1.f - a.beta) * k2 : k1;
  if (a.kind != Kind::kForward && g) denseSecondGrad(a, k, l, z, t, g, label, jsd ? k2 : k1);
}

__device__ __forceinline__ bool marked(const uint32_t* bits, int64_t j) { return (bits[j >> 5] >> (j & 31)) & 1u; }

// A top-k row's shared memory: the bitmap of its top-k ids, the student's top-k logits, and the
// k+1 buckets' student and teacher log-probabilities and gradients.
struct TopkShared {
  uint32_t* bits;
  float *zK, *lp, *lq, *gb;
  int64_t k; // 0: no KD (nothing marked)
};

// Marks the row's top-k ids (null buckets are not) and keeps the student's logits there.
template <typename TZ>
__device__ void markTopk(const RowArgs& a, const TopkShared& s, const TZ* z, const int64_t* idx, const bool* null) {
  const int64_t words = (a.v + 31) / 32;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) s.bits[w] = 0;
  __syncthreads();
  for (int64_t b = threadIdx.x; b < s.k; b += blockDim.x) {
    const bool nb = null && null[b];
    const int64_t j = idx[b];
    s.zK[b] = nb ? -kInf : toF(z[j]);
    if (!nb) atomicOr(s.bits + (j >> 5), 1u << (j & 31));
  }
  __syncthreads();
}

// The student's log-sum-exps: the row and its tail (the unmarked ids) at T, the row at 1.
struct TopkLse {
  float all, tail, one;
};

template <typename TZ>
__device__ TopkLse topkLse(const RowArgs& a, const Consts& k, const TopkShared& s, const TZ* z, float* sh) {
  Lse sAll, sTail, s1;
  const bool sep1 = a.needCe && !(k.t1 && s.k);
  for (int64_t j = threadIdx.x; j < a.v; j += blockDim.x) {
    const float x = toF(z[j]);
    if (s.k) {
      const float v = k.t1 ? x : x * k.invT;
      sAll.add(v);
      if (!marked(s.bits, j)) sTail.add(v);
    }
    if (sep1) s1.add(x);
  }
  TopkLse out;
  out.all = s.k ? blockLse(sAll, sh) : 0.f;
  out.tail = s.k ? blockLse(sTail, sh) : -kInf;
  out.one = sep1 ? blockLse(s1, sh) : out.all;
  return out;
}

// The teacher's k+1 bucket log-probabilities (losses.cpp's teacherBuckets) and the student's.
__device__ void topkBuckets(const RowArgs& a, const Consts& k, const TopkShared& s, const TopkLse& l, int64_t r,
                            float* sh) {
  __shared__ float rowVals[2]; // logsumexp only: the tail bucket and the shift of the top-k ones
  const int64_t kk = s.k;
  const float* vals = a.vals + r * kk;
  for (int64_t b = threadIdx.x; b < kk; b += blockDim.x) {
    s.lp[b] = s.zK[b] == -kInf ? -kInf : (k.t1 ? s.zK[b] : s.zK[b] * k.invT) - l.all;
    s.lq[b] = vals[b] * k.invT;
  }
  float shift = 0.f, logqTail = -kInf;
  if (!a.tLse && !a.tLogTail) { // the truncated target: softmax over the k values
    Lse m;
    for (int64_t b = threadIdx.x; b < kk; b += blockDim.x) m.add(vals[b] * k.invT);
    shift = blockLse(m, sh);
  } else if (a.tLogTail) {
    shift = a.tLogSum[r];
    logqTail = a.tLogTail[r] - shift;
  } else {
    if (threadIdx.x == 0) { // the tail is 1 - sum q_i, in log space, at least the rounding r where it matters
      const float lse = a.tLse[r], lseK = a.tLogSum[r] - lse;
      float tail = -kInf;
      if (!(kk == a.v && !a.null)) {
        const float x = fminf(lseK, 0.f);
        tail = x > -0.69314718f ? logf(-expm1f(x)) : log1pf(-expf(x));
        const float logR = logf(fmaxf(fabsf(lse), 1.f) * 4.f * a.eps);
        if (tail < logR) tail = l.tail == -kInf ? -kInf : logR;
      }
      const float norm = logaddexpF(lseK, tail);
      rowVals[0] = tail - norm;
      rowVals[1] = lse + norm;
    }
    __syncthreads();
    logqTail = rowVals[0], shift = rowVals[1];
  }
  for (int64_t b = threadIdx.x; b < kk; b += blockDim.x) s.lq[b] -= shift;
  if (threadIdx.x == 0) {
    s.lq[kk] = logqTail;
    s.lp[kk] = l.tail - l.all;
  }
  __syncthreads();
}

// The divergence over the k+1 buckets (returned, unscaled) and its gradient per bucket into gb
// (../cpu/loss_kernel_vec.h's divergenceArrays).
__device__ float bucketDivergence(const RowArgs& a, const Consts& k, const TopkShared& s, float* sh) {
  const bool jsd = a.kind == Kind::kJsd, fwd = a.kind == Kind::kForward;
  float k1 = 0, k2 = 0;
  for (int64_t b = threadIdx.x; b <= s.k; b += blockDim.x) {
    float q_l = s.lq[b], p_l = s.lp[b];
    if (fwd) {
      const float q = __expf(q_l);
      if (q > 0.f) k1 += q * (q_l - p_l);
    } else if (jsd) {
      q_l = fmaxf(q_l, kLogFloor), p_l = fmaxf(p_l, kLogFloor);
      const float logm = logaddexpF(q_l + k.logBeta, p_l + k.logBeta1);
      k1 += (q_l - logm) * __expf(q_l);
      k2 += (p_l - logm) * __expf(p_l);
    } else {
      const float p = __expf(p_l);
      if (p > 0.f) k1 += (p_l - q_l) * p;
    }
  }
  k1 = blockSum(k1, sh);
  if (jsd) k2 = blockSum(k2, sh);
  const float kl = jsd ? k2 : k1;
  for (int64_t b = threadIdx.x; b <= s.k; b += blockDim.x) {
    float q_l = s.lq[b], p_l = s.lp[b];
    if (fwd) {
      s.gb[b] = __expf(p_l) - __expf(q_l);
    } else if (jsd) {
      q_l = fmaxf(q_l, kLogFloor), p_l = fmaxf(p_l, kLogFloor);
      const float logm = logaddexpF(q_l + k.logBeta, p_l + k.logBeta1);
      s.gb[b] = (p_l - logm - kl) * __expf(p_l) * (1.f - a.beta);
    } else {
      const float p = __expf(p_l);
      s.gb[b] = p > 0.f ? (p_l - q_l - kl) * p : 0.f;
    }
  }
  __syncthreads();
  return jsd ? a.beta * k1 + (1.f - a.beta) * k2 : k1;
}

// The gradient: tail tokens (p_j / P_tail) gb[k] (the softmax of the tail logits) plus the CE's
// p1 - onehot; then the top-k tokens, from the logits kept in zK.
template <typename TZ>
__device__ void topkGrad(const RowArgs& a, const Consts& k, const TopkShared& s, const TopkLse& l, const TZ* z, TZ* g,
                         const int64_t* idx, const bool* null, int64_t label) {
  const float gTail = s.k && l.tail != -kInf ? s.gb[s.k] * k.ka : 0.f;
  for (int64_t j = threadIdx.x; j < a.v; j += blockDim.x) {
    if (s.k && marked(s.bits, j)) continue;
    const float x = toF(z[j]);
    float out = gTail != 0.f ? __expf((k.t1 ? x : x * k.invT) - l.tail) * gTail : 0.f;
    if (a.needCe) out += ceGrad(k.cce, x, l.one, j == label);
    g[j] = fromF<TZ>(out);
  }
  for (int64_t b = threadIdx.x; b < s.k; b += blockDim.x) {
    if (null && null[b]) continue;
    const int64_t j = idx[b];
    float out = s.gb[b] * k.ka;
    if (a.needCe) out += ceGrad(k.cce, s.zK[b], l.one, j == label);
    g[j] = fromF<TZ>(out);
  }
}

template <typename TZ>
__global__ void __launch_bounds__(kThreads) topkRows(RowArgs a) {
  extern __shared__ float dyn[];
  __shared__ float sh[64];
  const Consts k(a);
  const int64_t i = blockIdx.x, r = a.rows[i];
  TopkShared s;
  s.k = a.needKd ? a.k : 0;
  s.bits = reinterpret_cast<uint32_t*>(dyn);
  s.zK = dyn + (s.k ? (a.v + 31) / 32 : 0);
  s.lp = s.zK + s.k;
  s.lq = s.lp + s.k + 1;
  s.gb = s.lq + s.k + 1;
  const TZ* z = static_cast<const TZ*>(a.z) + r * a.zStride;
  TZ* g = a.grad ? static_cast<TZ*>(a.grad) + r * a.gStride : nullptr;
  const int64_t label = a.labels[r];
  const int64_t* idx = a.idx + r * s.k;
  const bool* null = a.null ? a.null + r * s.k : nullptr;
  const float zLabel = a.needCe ? toF(z[label]) : 0.f; // read before any write
  if (s.k) markTopk(a, s, z, idx, null);
  const TopkLse l = topkLse(a, k, s, z, sh);
  if (threadIdx.x == 0) a.ceRow[i] = a.needCe ? l.one - zLabel : 0.f;
  float kd = 0.f;
  if (s.k) {
    topkBuckets(a, k, s, l, r, sh);
    kd = bucketDivergence(a, k, s, sh);
  }
  if (threadIdx.x == 0) a.kdRow[i] = kd;
  if (g) topkGrad(a, k, s, l, z, g, idx, null, label);
}

template <typename TZ, typename TT>
cudaError_t launchDense(const RowArgs& a, cudaStream_t s) {
  denseRows<TZ, TT><<<static_cast<unsigned>(a.c), kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

template <typename TZ>
cudaError_t launchZ(const RowArgs& a, cudaStream_t s) {
  if (!(a.needKd && a.t)) {
    const int64_t bytes = a.needKd ? topkSharedBytes(a.v, a.k) : 0;
    if (bytes > 48 * 1024) {
      const cudaError_t e =
          cudaFuncSetAttribute(topkRows<TZ>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      if (e != cudaSuccess) return e;
    }
    topkRows<TZ><<<static_cast<unsigned>(a.c), kThreads, static_cast<size_t>(bytes), s>>>(a);
    return cudaGetLastError();
  }
  switch (a.tType) {
    case DType::kHalf:
      return launchDense<TZ, __half>(a, s);
    case DType::kBFloat16:
      return launchDense<TZ, __nv_bfloat16>(a, s);
    default:
      return launchDense<TZ, float>(a, s);
  }
}

} // namespace

int64_t topkSharedBytes(int64_t v, int64_t k) { return 4 * ((v + 31) / 32 + k + 3 * (k + 1)); }

const char* launchRows(const RowArgs& a, void* stream) {
  if (a.c == 0) return nullptr;
  if (a.c > 0x7fffffff) return "too many rows for one launch";
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  switch (a.zType) {
    case DType::kHalf:
      e = launchZ<__half>(a, s);
      break;
    case DType::kBFloat16:
      e = launchZ<__nv_bfloat16>(a, s);
      break;
    default:
      e = launchZ<float>(a, s);
  }
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

} // namespace distill::lossk::cuda
