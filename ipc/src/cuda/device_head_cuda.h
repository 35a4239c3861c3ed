#pragma once

// The CUDA runtime calls of device_head.cpp (device_head.h): implemented in
// device_head_cuda.cpp with CUDA, in device_head.cpp's stubs without. IpcError
// on any CUDA failure, naming the call and `what`.

#include <cstddef>
#include <cstdint>
#include <string>

namespace distill::ipc::cuda {

constexpr size_t kIpcHandleBytes = 64; // cudaIpcMemHandle_t

bool deviceHeadAvailable();
// The device's UUID (cudaDeviceProp::uuid) as 32 lowercase hex digits.
std::string deviceUuidHex(int device);
// cudaMalloc(bytes) on `device`, the host bytes copied in (weight, then bias at `weightBytes`),
// synchronised, and its IPC handle written to handle[kIpcHandleBytes]. Returns the device pointer.
void* copyAndExport(int device, const void* weight, size_t weightBytes, const void* bias, size_t biasBytes,
                    uint8_t* handle, const std::string& what);
// cudaIpcOpenMemHandle of `handle` on `device`; returns the device pointer.
void* importHandle(int device, const uint8_t* handle, const std::string& what);
// cudaIpcCloseMemHandle / cudaFree; errors are logged, not thrown (called from destructors).
void closeImported(int device, void* ptr, const std::string& what);
void freeExported(int device, void* ptr, const std::string& what);

} // namespace distill::ipc::cuda
