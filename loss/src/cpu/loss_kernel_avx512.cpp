// The fused loss kernel built for AVX-512 (F, BW, VL, DQ: what ATen's own
// AVX512 kernels need; loss/CMakeLists.txt sets the flags and
// CPU_CAPABILITY_AVX512, under which Vectorized<T> uses 512-bit registers and
// SLEEF's exp/log); used only where the CPU has them (loss_kernel.cpp).
#define DISTILL_LOSSK_NS avx512
#include "loss_kernel_impl.h"
