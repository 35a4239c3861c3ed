// The fused CPU kernel (loss_kernel.h) behind the RowKernel interface: a chunk's
// valid rows in parallel over threads, per-row sums added in row order (the same
// value for any thread count).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../loss_problem.h"
#include "../row_kernel.h"
#include "loss_kernel.h"

namespace distill::loss_impl {

namespace {

// The teacher's side of the kernel's arguments; `tChunk` keeps the chunk's
// teacher rows alive when they had to be converted.
template <typename T>
void teacherArgs(const Problem& pb, const at::Tensor& rows, lossk::Args<T>& a, at::Tensor& tChunk) {
  if (!pb.needKd) return;
  if (pb.tLogits.defined()) {
    if (pb.tLogits.scalar_type() == pb.compute && pb.tLogits.is_contiguous()) {
      a.t = pb.tLogits.data_ptr<T>();
      a.tRows = a.rows;
    } else {
      tChunk = pb.tLogits.index_select(0, rows).to(pb.compute).contiguous();
      a.t = tChunk.data_ptr<T>();
    }
    return;
  }
  a.k = pb.tIndices.size(1);
  a.idx = pb.tIndices.data_ptr<int64_t>();
  if (pb.tWeights.defined()) { // sampled targets
    a.w = pb.tWeights.data_ptr<T>();
  } else if (pb.sampledToken) {
    a.logq = pb.kLogq.data_ptr<T>();
    if (pb.kSamplingLogp.defined()) a.sampleLogp = pb.kSamplingLogp.data_ptr<T>();
    a.ratioMax = kSampledTokenMaxRatio;
  } else { // top-k
    a.vals = pb.kValues.data_ptr<T>();
    if (pb.kLse.defined()) a.tLse = pb.kLse.data_ptr<T>();
    if (pb.kLogTail.defined()) a.tLogTail = pb.kLogTail.data_ptr<T>();
    if (pb.tLogSum.defined()) a.tLogSum = pb.tLogSum.data_ptr<T>();
  }
}

// The kernel function for pb's teacher form.
template <typename T>
auto kernelFn(const Problem& pb) {
  const lossk::Kernels& kern = lossk::kernels();
  const bool sampled = pb.tWeights.defined() || pb.sampledToken;
  if constexpr (std::is_same_v<T, float>) {
    return pb.tLogits.defined() ? kern.denseF : sampled ? kern.sampledF : kern.topkF;
  } else {
    return pb.tLogits.defined() ? kern.denseD : sampled ? kern.sampledD : kern.topkD;
  }
}

template <typename T>
void cpuChunk(const Problem& pb, const at::Tensor& rows, const at::Tensor& grad, Sums& sums) {
  const int64_t c = rows.size(0);
  lossk::Args<T> a;
  a.kind = pb.kind;
  a.temperature = pb.temperature;
  a.alpha = pb.alpha;
  a.beta = pb.beta;
  a.normalizer = pb.normalizer;
  a.eps = pb.eps;
  a.needKd = pb.needKd;
  a.needCe = pb.needCe;
  a.v = pb.v;
  a.z = pb.zc.data_ptr<T>();
  a.rows = rows.data_ptr<int64_t>();
  a.labels = pb.labels.data_ptr<int64_t>();
  a.grad = grad.defined() ? grad.data_ptr<T>() : nullptr;
  at::Tensor tChunk; // the chunk's teacher rows, only when they must be converted
  teacherArgs(pb, rows, a, tChunk);
  std::vector<double> kd(c, 0.0), ce(c, 0.0);
  a.kdRow = kd.data();
  a.ceRow = ce.data();
  void (*fn)(const lossk::Args<T>&, int64_t, int64_t, T*) = kernelFn<T>(pb);
  const bool sampled = pb.tWeights.defined() || pb.sampledToken; // no scratch
  const int64_t scratch = sampled ? 0 : lossk::scratchSize(pb.v, a.k);
  at::parallel_for(0, c, std::max<int64_t>(1, 16384 / pb.v), [&](int64_t b, int64_t e) {
    std::vector<T> buf(scratch, T(0));
    fn(a, b, e, buf.data());
  });
  // Row sums in row order: the same value for any thread count.
  double kdTotal = 0, ceTotal = 0;
  for (int64_t i = 0; i < c; ++i) {
    kdTotal += kd[i];
    ceTotal += ce[i];
  }
  if (pb.needKd) sums.kd.add_(kdTotal);
  if (pb.needCe) sums.ce.add_(ceTotal);
}

class CpuRowKernel final : public RowKernel {
 public:
  bool adopt(Problem& pb) const override {
    // Null buckets (a truncated top-k that dropped entries) only the ATen-op path takes.
    return (pb.compute == at::kFloat || pb.compute == at::kDouble) && !pb.tNull.defined();
  }
  void run(const Problem& pb, const at::Tensor& rows, const at::Tensor& grad, Sums& sums) const override {
    if (pb.compute == at::kDouble) return cpuChunk<double>(pb, rows, grad, sums);
    cpuChunk<float>(pb, rows, grad, sums);
  }
  // Reverse KL and JSD reread a row's logits after writing its gradient row.
  bool inPlace() const override { return false; }
};

} // namespace

const RowKernel* cpuRowKernel() {
  static const CpuRowKernel k;
  return &k;
}

} // namespace distill::loss_impl
