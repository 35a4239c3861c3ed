// The fused loss kernel for any CPU (ATen's portable Vectorized<T>).
#define DISTILL_LOSSK_NS portable
#include "loss_kernel_impl.h"
