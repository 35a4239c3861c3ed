#include "row_kernel.h"

#include "distill/build_config.h"

namespace distill::loss_impl {

#if !DISTILL_CUDA
const RowKernel* cudaRowKernel() { return nullptr; }
#endif

const RowKernel* rowKernel(c10::DeviceType device) {
  switch (device) {
    case c10::DeviceType::CPU:
      return cpuRowKernel();
    case c10::DeviceType::CUDA:
      return cudaRowKernel();
    default:
      return nullptr;
  }
}

} // namespace distill::loss_impl
