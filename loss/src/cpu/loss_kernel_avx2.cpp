// The fused loss kernel built for AVX2 + FMA (loss/CMakeLists.txt sets the
// flags and CPU_CAPABILITY_AVX2, under which ATen's Vectorized<T> uses 256-bit
// registers and SLEEF's exp/log); used only where the CPU has both
// (loss_kernel.cpp).
#define DISTILL_LOSSK_NS avx2
#include "loss_kernel_impl.h"
