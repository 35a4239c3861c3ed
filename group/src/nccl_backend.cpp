#include "nccl_backend.h"

#include "distill/build_config.h"
#include "distill/core/errors.h"

#if DISTILL_CUDA
// ProcessGroupNCCL.hpp declares nothing without USE_C10D_NCCL (torch's own
// build defines it); defined here rather than as a source property so that
// this file joins the library's unity translation unit.
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace distill {

int visibleCudaDevices() {
#if DISTILL_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

c10::intrusive_ptr<c10d::Backend> makeNcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                  std::chrono::milliseconds timeout, const std::string& device) {
#if DISTILL_CUDA
  DISTILL_CHECK_T(ConfigError, c10::cuda::device_count() > 0,
                  "student.backend needs NCCL but no CUDA device is visible (student.device=", device, ")");
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), rank, size, opts);
#else
  DISTILL_THROW(ConfigError, "student.backend needs NCCL (student.device=", device,
                ") but distill was built with DISTILL_CUDA=OFF");
#endif
}

} // namespace distill
