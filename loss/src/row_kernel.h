#pragma once

// The row kernels behind the chunks of a loss (losses.cpp, fused_linear.cpp):
// one interface, one implementation per device, as siblings:
//   cpu/row_kernel_cpu.cpp    the fused CPU kernel (cpu/loss_kernel.h), float32 | float64
//   cuda/row_kernel_cuda.cpp  the CUDA row kernel (cuda/loss_rows.cu), float32 | float16 | bfloat16
// A Problem that no kernel adopts (Problem::kernel null) runs on the ATen-op
// path of losses.cpp, which is also the kernels' reference in tests.

#include <ATen/core/Tensor.h>

namespace distill::loss_impl {

struct Problem;
struct Sums;

class RowKernel {
 public:
  virtual ~RowKernel() = default;
  // Takes a prepared Problem (its inputs checked, its teacher truncated), adding
  // the inputs it needs converted; false: the ATen-op path computes it.
  virtual bool adopt(Problem& pb) const = 0;
  // The valid rows `rows` ([C] int64 ids, on pb's device) of pb.zc [N, V]: adds
  // their kd and ce sums to `sums` (0-dim double, on the device: no host sync
  // on CUDA) and, when `grad` is defined, writes d loss / d z into grad's rows.
  // grad may be pb.zc itself where inPlace().
  virtual void run(const Problem& pb, const at::Tensor& rows, const at::Tensor& grad, Sums& sums) const = 0;
  virtual bool inPlace() const = 0;
};

// The kernel for a device type: the CPU's always, CUDA's when DISTILL_CUDA
// built it (null otherwise), null for any other device.
const RowKernel* rowKernel(c10::DeviceType device);

const RowKernel* cpuRowKernel();
const RowKernel* cudaRowKernel(); // null without DISTILL_CUDA

} // namespace distill::loss_impl
