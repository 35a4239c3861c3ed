// CUDA's memory for the device head (device_memory.h; device_head.h has the contract).
#include <cuda_runtime_api.h>

#include <cstring>

#include "../device_memory.h"
#include "cuda_call.h"
#include "distill/core/logging.h"

namespace distill::ipc {

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == DeviceMemory::kHandleBytes, "handle size");

class CudaMemory final : public DeviceMemory {
 public:
  bool available() const override { return true; }

  std::string uuidHex(int device) const override {
    cudaDeviceProp prop{};
    DISTILL_CUDA_CALL(cudaGetDeviceProperties(&prop, device), "the UUID of cuda:", device);
    static const char* digits = "0123456789abcdef";
    std::string s;
    for (char c : prop.uuid.bytes) {
      const auto b = static_cast<unsigned char>(c);
      s += digits[b >> 4];
      s += digits[b & 15];
    }
    return s;
  }

  void* copyAndExport(int device, const void* weight, size_t weightBytes, const void* bias, size_t biasBytes,
                      uint8_t* handle, const std::string& what) const override {
    cuda::DeviceGuard g(device);
    void* data = nullptr;
    DISTILL_CUDA_CALL(cudaMalloc(&data, weightBytes + biasBytes), what, ": ", weightBytes + biasBytes,
                      " bytes on cuda:", device);
    try {
      // Synchronous copies from pageable host memory (the mapping): complete when they return.
      DISTILL_CUDA_CALL(cudaMemcpy(data, weight, weightBytes, cudaMemcpyHostToDevice), what);
      if (biasBytes) {
        DISTILL_CUDA_CALL(
            cudaMemcpy(static_cast<char*>(data) + weightBytes, bias, biasBytes, cudaMemcpyHostToDevice), what);
      }
      DISTILL_CUDA_CALL(cudaDeviceSynchronize(), what);
      cudaIpcMemHandle_t h;
      DISTILL_CUDA_CALL(cudaIpcGetMemHandle(&h, data), what);
      std::memcpy(handle, &h, sizeof h);
    } catch (...) {
      cudaFree(data);
      throw;
    }
    return data;
  }

  void* importHandle(int device, const uint8_t* handle, const std::string& what) const override {
    cuda::DeviceGuard g(device);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, sizeof h);
    void* data = nullptr;
    DISTILL_CUDA_CALL(cudaIpcOpenMemHandle(&data, h, cudaIpcMemLazyEnablePeerAccess), what, " on cuda:", device);
    return data;
  }

  void closeImported(int device, void* ptr, const std::string& what) const override {
    cuda::DeviceGuard g(device);
    const cudaError_t e = cudaIpcCloseMemHandle(ptr);
    if (e != cudaSuccess) {
      DISTILL_LOG(kWarning) << what << ": cudaIpcCloseMemHandle failed: " << cudaGetErrorString(e);
    }
  }

  void freeExported(int device, void* ptr, const std::string& what) const override {
    cuda::DeviceGuard g(device);
    const cudaError_t e = cudaFree(ptr);
    if (e != cudaSuccess) {
      DISTILL_LOG(kWarning) << what << ": cudaFree failed: " << cudaGetErrorString(e);
    }
  }
};

} // namespace

const DeviceMemory& cudaDeviceMemory() {
  static const CudaMemory m;
  return m;
}

} // namespace distill::ipc
