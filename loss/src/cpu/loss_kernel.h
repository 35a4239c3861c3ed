#pragma once

// The fused CPU kernel of distillLoss (losses.cpp): one call handles some
// valid token rows of one chunk, each row read from cache a few times (max,
// sums, then the gradient write) instead of the ~10 full passes and [C, V]
// temporaries of the ATen-op path. No torch here: plain pointers, so the
// kernel can be compiled once per instruction set (loss_kernel_avx512.cpp,
// loss_kernel_avx2.cpp, and loss_kernel_default.cpp for any CPU) and picked at run time, the way
// ATen builds its own CPU kernels.

#include <cstdint>

namespace distill::lossk {

enum class Kind { kForward, kReverse, kJsd };

template <typename T>
struct Args {
  Kind kind = Kind::kForward;
  double temperature = 1, alpha = 0.5, beta = 0.5, normalizer = 1, eps = 0;
  bool needKd = true, needCe = true;
  int64_t v = 0;
  const T* z = nullptr; // student logits [N, V], rows contiguous
  const int64_t* rows = nullptr; // [C]: row ids (into z, labels, grad and the top-k data) of this chunk
  const int64_t* labels = nullptr; // [N]
  T* grad = nullptr; // [N, V], or null: values only
  // Dense teacher: logits of chunk row i at t + (tRows ? tRows[i] : i) * V.
  const T* t = nullptr;
  const int64_t* tRows = nullptr;
  // Top-k teacher, indexed by row id: values [N, k], indices [N, k], and [N]
  // each for logsumexp, log tail and logSum (losses.cpp's Problem::tLogSum);
  // the last three may be null.
  int64_t k = 0;
  const T* vals = nullptr;
  const int64_t* idx = nullptr;
  const T* tLse = nullptr;
  const T* tLogTail = nullptr;
  const T* tLogSum = nullptr;
  // Sampled targets (sampledF/D with w set): idx [N, k] the drawn ids, w [N, k]
  // their counts / K (0: padding). loss.kind sampled_token (logq set): idx
  // [N, 1] the sampled id, logq [N] the teacher's log-probability of it at T,
  // sampleLogp [N] the sampling policy's log-probability of it (or null: no
  // importance weight), the weight truncated at ratioMax.
  const T* w = nullptr;
  const T* logq = nullptr;
  const T* sampleLogp = nullptr;
  double ratioMax = 0;
  // Per chunk row: the unscaled divergence and the cross-entropy.
  double* kdRow = nullptr;
  double* ceRow = nullptr;
};

// Scratch one thread needs for rows of vocabulary v with top-k k, in elements
// of T; it must be zero-filled before the first call (the kernel leaves it so).
inline int64_t scratchSize(int64_t v, int64_t k) { return v + 5 * (k + 1 + 16) + 64; }

struct Kernels {
  void (*denseF)(const Args<float>&, int64_t begin, int64_t end, float* scratch);
  void (*denseD)(const Args<double>&, int64_t begin, int64_t end, double* scratch);
  void (*topkF)(const Args<float>&, int64_t begin, int64_t end, float* scratch);
  void (*topkD)(const Args<double>&, int64_t begin, int64_t end, double* scratch);
  // Sampled targets or loss.kind sampled_token (loss_kernel_sampled.h); no scratch.
  void (*sampledF)(const Args<float>&, int64_t begin, int64_t end, float* scratch);
  void (*sampledD)(const Args<double>&, int64_t begin, int64_t end, double* scratch);
  // out[r] = logsumexp(x[r, :] / temperature) for rows [0, n) of x [n, k]
  // (-inf for a row of -inf), as at::logsumexp.
  void (*rowLogsumexpF)(const float* x, int64_t n, int64_t k, double temperature, float* out);
  void (*rowLogsumexpD)(const double* x, int64_t n, int64_t k, double temperature, double* out);
};

// The kernels for this CPU: the widest build the CPU runs (AVX-512, else
// AVX2+FMA, else the portable one), as ATen picks its own CPU kernels.
const Kernels& kernels();

namespace avx512 {
const Kernels* kernels(); // null when not built
}
namespace avx2 {
const Kernels* kernels(); // null when not built
}
namespace portable {
const Kernels* kernels();
}

} // namespace distill::lossk
