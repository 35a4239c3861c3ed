// The CUDA row kernel (loss_rows.cu) behind the RowKernel interface. Nothing
// here waits for the device: the rows' loss parts go into a [2, C] float32
// buffer and are summed into the call's double accumulators by ATen on the
// same stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../loss_problem.h"
#include "../row_kernel.h"
#include "distill/core/errors.h"
#include "loss_rows.h"

namespace distill::loss_impl {

namespace {

namespace lkc = lossk::cuda;

bool typeOf(at::ScalarType t, lkc::DType& out) {
  switch (t) {
    case at::kFloat:
      out = lkc::DType::kFloat;
      return true;
    case at::kHalf:
      out = lkc::DType::kHalf;
      return true;
    case at::kBFloat16:
      out = lkc::DType::kBFloat16;
      return true;
    default:
      return false;
  }
}

const float* floatPtr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

class CudaRowKernel final : public RowKernel {
 public:
  bool adopt(Problem& pb) const override {
    lkc::DType dt;
    if (pb.compute != at::kFloat) return false;
    if (pb.needKd && pb.tLogits.defined()) {
      if (!typeOf(pb.tLogits.scalar_type(), dt) || pb.tLogits.stride(1) != 1) return false;
    } else if (pb.needKd) {
      const int64_t k = pb.tIndices.size(1);
      if (lkc::topkSharedBytes(pb.v, k) > lkc::kMaxSharedBytes) return false;
      // The kernel's inputs, converted once (O(N k)), after loss.vocab truncate changed them.
      pb.kValues = pb.tValues.to(at::kFloat).contiguous();
      pb.tIndices = pb.tIndices.contiguous();
      if (pb.tLse.defined()) pb.kLse = pb.tLse.to(at::kFloat).contiguous();
      if (pb.tLogTail.defined()) pb.kLogTail = pb.tLogTail.to(at::kFloat).contiguous();
      if (pb.tLogSum.defined()) pb.tLogSum = pb.tLogSum.to(at::kFloat).contiguous();
      if (pb.tNull.defined()) pb.tNull = pb.tNull.contiguous();
    }
    pb.labels = pb.labels.contiguous();
    return true;
  }

  void run(const Problem& pb, const at::Tensor& rows, const at::Tensor& grad, Sums& sums) const override {
    const at::Tensor& z = pb.zc;
    lkc::RowArgs a;
    DISTILL_INTERNAL_ASSERT(typeOf(z.scalar_type(), a.zType) && z.dim() == 2 && z.stride(1) == 1 &&
                                (!grad.defined() || (grad.scalar_type() == z.scalar_type() && grad.stride(1) == 1)),
                            "CUDA row kernel: logits ", shapeOf(z), " ", c10::toString(z.scalar_type()));
    const c10::cuda::CUDAGuard guard(z.device());
    a.kind = static_cast<lkc::Kind>(static_cast<int>(pb.kind));
    a.temperature = static_cast<float>(pb.temperature);
    a.alpha = static_cast<float>(pb.alpha);
    a.beta = static_cast<float>(pb.beta);
    a.normalizer = static_cast<float>(pb.normalizer);
    a.eps = static_cast<float>(pb.eps);
    a.needKd = pb.needKd;
    a.needCe = pb.needCe;
    a.v = pb.v;
    const at::Tensor ids = rows.contiguous();
    a.c = ids.size(0);
    a.rows = ids.data_ptr<int64_t>();
    a.labels = pb.labels.data_ptr<int64_t>();
    a.z = z.data_ptr();
    a.zStride = z.stride(0);
    if (grad.defined()) {
      a.grad = grad.data_ptr();
      a.gStride = grad.stride(0);
    }
    if (pb.needKd && pb.tLogits.defined()) {
      typeOf(pb.tLogits.scalar_type(), a.tType);
      a.t = pb.tLogits.data_ptr();
      a.tStride = pb.tLogits.stride(0);
    } else if (pb.needKd) {
      a.k = pb.tIndices.size(1);
      a.vals = floatPtr(pb.kValues);
      a.idx = pb.tIndices.data_ptr<int64_t>();
      a.tLse = floatPtr(pb.kLse);
      a.tLogTail = floatPtr(pb.kLogTail);
      a.tLogSum = floatPtr(pb.tLogSum);
      a.null = pb.tNull.defined() ? pb.tNull.data_ptr<bool>() : nullptr;
    }
    at::Tensor parts = at::empty({2, a.c}, z.options().dtype(at::kFloat));
    a.kdRow = parts.data_ptr<float>();
    a.ceRow = a.kdRow + a.c;
    const char* err = lkc::launchRows(a, c10::cuda::getCurrentCUDAStream(z.device().index()).stream());
    DISTILL_INTERNAL_ASSERT(err == nullptr, "CUDA row kernel: launch of ", a.c, " rows of ", a.v,
                            " failed: ", err ? err : "");
    if (pb.needKd) sums.kd.add_(parts[0].sum(at::kDouble));
    if (pb.needCe) sums.ce.add_(parts[1].sum(at::kDouble));
  }

  bool inPlace() const override { return true; }
};

} // namespace

const RowKernel* cudaRowKernel() {
  static const CudaRowKernel k;
  return &k;
}

} // namespace distill::loss_impl
