#include "loss_kernel.h"

namespace distill::lossk {

#ifndef DISTILL_LOSSK_X86
namespace avx512 {
const Kernels* kernels() { return nullptr; }
} // namespace avx512
namespace avx2 {
const Kernels* kernels() { return nullptr; }
} // namespace avx2
#endif

const Kernels& kernels() {
  static const Kernels* chosen = [] {
#if defined(DISTILL_LOSSK_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq")) {
      return avx512::kernels();
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2::kernels();
#endif
    return portable::kernels();
  }();
  return *chosen;
}

} // namespace distill::lossk
