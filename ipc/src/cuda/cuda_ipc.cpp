// CUDA IPC buffers; see cuda_ipc.h. Plain C++ calling the CUDA runtime API.
#include "cuda_ipc.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "../segment_impl.h"
#include "distill/core/errors.h"

namespace distill::ipc::cuda {

static_assert(sizeof(cudaIpcMemHandle_t) == wire::kCudaIpcHandleBytes, "handle size");
static_assert(sizeof(cudaIpcEventHandle_t) == wire::kCudaIpcHandleBytes, "handle size");

namespace {

#define DISTILL_CUDA_CALL(expr, ...)                                                                 \
  do {                                                                                               \
    cudaError_t err_ = (expr);                                                                       \
    if (err_ != cudaSuccess)                                                                         \
      DISTILL_THROW(IpcError, #expr, " failed: ", cudaGetErrorString(err_), " (", __VA_ARGS__, ")"); \
  } while (0)

// Restores the caller's current device.
struct DeviceGuard {
  int prev = 0;
  explicit DeviceGuard(int d) {
    cudaGetDevice(&prev);
    if (d != prev) cudaSetDevice(d);
  }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

} // namespace

int currentDevice() {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return d;
}

int deviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError(); // clear the sticky-free error
    return 0;
  }
  return n;
}

ConsumerBuffers::ConsumerBuffers(const SegmentImpl& seg, int student, bool response, int device)
    : seg_(seg), student_(student), response_(response), device_(device) {
  auto& ring = seg.ring(student, response);
  const uint64_t slotBytes = wire::alignUp(uint64_t(seg.capacity(response)), 256);
  DeviceGuard g(device);
  DISTILL_CUDA_CALL(cudaMalloc(&base_, slotBytes * uint64_t(seg.layout.slots)), "segment '", seg.name, "', ",
                    seg.layout.slots, " slots of ", slotBytes, " bytes on cuda:", device);
  cudaIpcMemHandle_t h;
  DISTILL_CUDA_CALL(cudaIpcGetMemHandle(&h, base_), "segment '", seg.name, "'");
  DISTILL_CUDA_CALL(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(&doneEvent_), cudaEventDisableTiming),
                    "segment '", seg.name, "'");
  ring.cudaSlotBytes = slotBytes;
  ring.cudaDevice = device;
  std::memcpy(ring.cudaMem, &h, sizeof h);
  ring.cudaMemReady.store(1, std::memory_order_release);
  events_.reset(new void*[size_t(seg.layout.slots)]());
}

ConsumerBuffers::~ConsumerBuffers() {
  seg_.ring(student_, response_).cudaMemReady.store(0, std::memory_order_release);
  DeviceGuard g(device_);
  for (int i = 0; events_ && i < seg_.layout.slots; ++i)
    if (events_[i]) cudaEventDestroy(static_cast<cudaEvent_t>(events_[i]));
  if (doneEvent_) cudaEventDestroy(static_cast<cudaEvent_t>(doneEvent_));
  if (base_) cudaFree(base_);
}

void* ConsumerBuffers::slotPtr(uint64_t slot) const {
  return static_cast<char*>(base_) + slot * seg_.ring(student_, response_).cudaSlotBytes;
}

bool ConsumerBuffers::waitWritten(uint64_t slot, void* stream) {
  auto& ring = seg_.ring(student_, response_);
  if (!events_[slot]) {
    if (!ring.cudaEventsReady.load(std::memory_order_acquire)) return false;
    cudaIpcEventHandle_t h;
    std::memcpy(&h, seg_.ringEvents(student_, response_) + slot * wire::kCudaIpcHandleBytes, sizeof h);
    cudaEvent_t ev;
    DISTILL_CUDA_CALL(cudaIpcOpenEventHandle(&ev, h), "segment '", seg_.name, "', slot ", slot);
    events_[slot] = ev;
  }
  DISTILL_CUDA_CALL(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(events_[slot]), 0),
                    "segment '", seg_.name, "'");
  return true;
}

void ConsumerBuffers::readsDone(void* stream) {
  auto ev = static_cast<cudaEvent_t>(doneEvent_);
  DISTILL_CUDA_CALL(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)), "segment '", seg_.name, "'");
  DISTILL_CUDA_CALL(cudaEventSynchronize(ev), "segment '", seg_.name, "'");
}

ProducerBuffers::ProducerBuffers(const SegmentImpl& seg, int student, bool response, int device)
    : seg_(seg), student_(student), response_(response), device_(device) {
  DeviceGuard g(device);
  events_.reset(new void*[size_t(seg.layout.slots)]());
  char* handles = seg.ringEvents(student, response);
  for (int i = 0; i < seg.layout.slots; ++i) {
    cudaEvent_t ev;
    DISTILL_CUDA_CALL(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming), "segment '",
                      seg.name, "'");
    events_[i] = ev;
    cudaIpcEventHandle_t h;
    DISTILL_CUDA_CALL(cudaIpcGetEventHandle(&h, ev), "segment '", seg.name, "'");
    std::memcpy(handles + size_t(i) * wire::kCudaIpcHandleBytes, &h, sizeof h);
  }
  seg.ring(student, response).cudaEventsReady.store(1, std::memory_order_release);
}

ProducerBuffers::~ProducerBuffers() {
  seg_.ring(student_, response_).cudaEventsReady.store(0, std::memory_order_release);
  DeviceGuard g(device_);
  if (peerBase_) cudaIpcCloseMemHandle(peerBase_);
  for (int i = 0; events_ && i < seg_.layout.slots; ++i)
    if (events_[i]) cudaEventDestroy(static_cast<cudaEvent_t>(events_[i]));
}

bool ProducerBuffers::ready() {
  if (peerBase_) return true;
  auto& ring = seg_.ring(student_, response_);
  if (!ring.cudaMemReady.load(std::memory_order_acquire)) return false;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, ring.cudaMem, sizeof h);
  DeviceGuard g(device_);
  DISTILL_CUDA_CALL(cudaIpcOpenMemHandle(&peerBase_, h, cudaIpcMemLazyEnablePeerAccess), "segment '", seg_.name,
                    "', buffer of cuda:", ring.cudaDevice, " opened on cuda:", device_);
  return true;
}

int ProducerBuffers::consumerDevice() const { return seg_.ring(student_, response_).cudaDevice; }

void ProducerBuffers::copyIn(uint64_t slot, uint64_t offset, const void* src, size_t n, void* stream) {
  char* dst = static_cast<char*>(peerBase_) + slot * seg_.ring(student_, response_).cudaSlotBytes + offset;
  DISTILL_CUDA_CALL(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), "segment '",
                    seg_.name, "', ", n, " bytes into slot ", slot);
}

void ProducerBuffers::recordWritten(uint64_t slot, void* stream) {
  DISTILL_CUDA_CALL(cudaEventRecord(static_cast<cudaEvent_t>(events_[slot]), static_cast<cudaStream_t>(stream)),
                    "segment '", seg_.name, "', slot ", slot);
}

} // namespace distill::ipc::cuda
