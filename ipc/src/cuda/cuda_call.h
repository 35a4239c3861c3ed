#pragma once

// The CUDA runtime call check and device guard of ipc/src/cuda/ (CUDA builds only).
#include <cuda_runtime_api.h>

#include "distill/core/errors.h"

// An IpcError naming the call, CUDA's words and the context given.
#define DISTILL_CUDA_CALL(expr, ...)                                                                 \
  do {                                                                                               \
    cudaError_t err_ = (expr);                                                                       \
    if (err_ != cudaSuccess)                                                                         \
      DISTILL_THROW(IpcError, #expr, " failed: ", cudaGetErrorString(err_), " (", __VA_ARGS__, ")"); \
  } while (0)

namespace distill::ipc::cuda {

// Makes `d` the calling thread's device and restores the caller's at scope exit.
struct DeviceGuard {
  int prev = 0;
  explicit DeviceGuard(int d) {
    cudaGetDevice(&prev);
    if (d != prev) cudaSetDevice(d);
  }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

} // namespace distill::ipc::cuda
