#pragma once

// The CUDA row kernel of the distillation loss (loss_rows.cu): one thread block
// per valid row of a chunk. Per row it reads the student's logits (and the
// teacher's) a few times from global memory (online max and sum of exp, then
// the divergence, then the gradient) and writes d loss / d logits once, in
// place over the logits when `grad` == `z`. The formulas are those of the CPU
// kernel (../cpu/loss_kernel_impl.h) and of losses.cpp's ATen-op path;
// arithmetic is float32 whatever the logits' dtype.
//
// No torch and no CUDA types here: plain pointers and a `void*` stream, so the
// torch side (row_kernel_cuda.cpp) and nvcc share this header and the .cu
// compiles without LibTorch's headers.

#include <cstdint>

namespace distill::lossk::cuda {

enum class DType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };
enum class Kind : int { kForward = 0, kReverse = 1, kJsd = 2 }; // as lossk::Kind

struct RowArgs {
  Kind kind = Kind::kForward;
  float temperature = 1, alpha = 0.5f, beta = 0.5f, normalizer = 1, eps = 0;
  bool needKd = true, needCe = true;
  int64_t v = 0; // the student's vocabulary: a row's width
  int64_t c = 0; // rows in this call (one block each)
  const int64_t* rows = nullptr; // [c] device: the rows' ids into labels, the teacher's data, and z / grad
  const int64_t* labels = nullptr; // [N] device, indexed by row id (every row of `rows` is valid)
  const void* z = nullptr; // student logits, row r at z + r * zStride elements of zType
  DType zType = DType::kFloat;
  int64_t zStride = 0;
  void* grad = nullptr; // d loss / d z, row r at grad + r * gStride (zType), or null: values only.
                        // May equal z (in place): each element is read before it is written.
  int64_t gStride = 0;
  // Dense teacher: logits of row r at t + r * tStride (tType, unit stride within a row).
  const void* t = nullptr;
  DType tType = DType::kFloat;
  int64_t tStride = 0;
  // Top-k teacher (when t is null and needKd): per row r, k values (float32, the teacher's logits),
  // k indices (int64), and float32 [N] logsumexp, log tail and logSum (losses.h "Top-k"; each
  // may be null as Problem's are); `null` [N, k] (or null): buckets loss.vocab truncate dropped.
  int64_t k = 0;
  const float* vals = nullptr;
  const int64_t* idx = nullptr;
  const float* tLse = nullptr;
  const float* tLogTail = nullptr;
  const float* tLogSum = nullptr;
  const bool* null = nullptr;
  // Out, per call row i (not row id): the unscaled divergence and the cross-entropy (0 where
  // not computed).
  float* kdRow = nullptr;
  float* ceRow = nullptr;
};

// The dynamic shared memory a top-k row needs (the top-k bitmap of the vocabulary
// and the k+1 buckets), and the most the kernel asks for: beyond it
// (k and V both large) the caller takes the ATen-op path.
int64_t topkSharedBytes(int64_t v, int64_t k);
constexpr int64_t kMaxSharedBytes = 160 * 1024;

// Launches the rows on `stream` (a cudaStream_t) without waiting for them.
// Returns null, or the CUDA error's text (a launch that failed).
const char* launchRows(const RowArgs& a, void* stream);

} // namespace distill::lossk::cuda
