#pragma once

// Where the device head's memory comes from (device_head.h): CUDA's device
// memory and IPC handles (cuda/device_head_cuda.cpp), or, in tests, any memory
// one process can export by a handle of kHandleBytes and another import
// (tests/ipc/device_head_test.cpp: POSIX shared memory), so that the record,
// the election, the waits and the release run on machines without a GPU.

#include <cstddef>
#include <cstdint>
#include <string>

namespace distill::ipc {

class DeviceMemory {
 public:
  static constexpr size_t kHandleBytes = 64; // cudaIpcMemHandle_t

  virtual ~DeviceMemory() = default;
  virtual bool available() const = 0;
  // The device's identity across processes (CUDA: cudaDeviceProp::uuid), as lowercase hex.
  virtual std::string uuidHex(int device) const = 0;
  // Allocates weightBytes + biasBytes on `device`, copies the host bytes in (weight, then bias),
  // completes the copies and writes the allocation's handle to handle[kHandleBytes]. IpcError
  // naming the call and `what`.
  virtual void* copyAndExport(int device, const void* weight, size_t weightBytes, const void* bias, size_t biasBytes,
                              uint8_t* handle, const std::string& what) const = 0;
  // Opens another process's allocation by its handle.
  virtual void* importHandle(int device, const uint8_t* handle, const std::string& what) const = 0;
  // Release: failures are logged, not thrown (destructors call them).
  virtual void closeImported(int device, void* ptr, const std::string& what) const = 0;
  virtual void freeExported(int device, void* ptr, const std::string& what) const = 0;
  // Called once when a student starts waiting for another to make the copy (tests order on it).
  virtual void awaiting() const {}
};

// CUDA's (with CUDA compiled in; without, one whose available() is false and whose calls throw).
const DeviceMemory& cudaDeviceMemory();

// The memory DeviceHead::share uses from now on in this process: `m`, or CUDA's again for
// nullptr. For tests; set it before any share().
void setDeviceMemoryForTests(const DeviceMemory* m);
const DeviceMemory& deviceMemory();

} // namespace distill::ipc
