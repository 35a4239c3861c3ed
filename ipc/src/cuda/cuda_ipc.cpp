// CUDA IPC buffers; see cuda_ipc.h. Plain C++ calling the CUDA runtime API; the
// driver's stream memory operations are reached through the runtime's driver
// entry points (cuda.h is included for its types only: nothing links libcuda).
#include "cuda_ipc.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "../segment_impl.h"
#include "cuda_call.h"
#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"

namespace distill::ipc::cuda {

static_assert(sizeof(cudaIpcMemHandle_t) == wire::kCudaIpcHandleBytes, "handle size");
static_assert(sizeof(cudaIpcEventHandle_t) == wire::kCudaIpcHandleBytes, "handle size");
static_assert(sizeof(cudaUUID_t) == sizeof(FlagControl::consumerUuid), "uuid size");

namespace {

#define DISTILL_CU_CALL(expr, ...)                                                                                     \
  do {                                                                                                                 \
    CUresult err_ = (expr);                                                                                            \
    if (err_ != CUDA_SUCCESS) DISTILL_THROW(IpcError, #expr, " failed: CUresult ", int(err_), " (", __VA_ARGS__, ")"); \
  } while (0)

// ---- the driver's stream memory operations, found once per process ----

struct Driver {
  PFN_cuStreamWriteValue64_v11070 write64 = nullptr;
  PFN_cuStreamWaitValue64_v11070 wait64 = nullptr;
  PFN_cuDeviceGet_v2000 deviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 getAttribute = nullptr;
  std::string missing; // why not all were found ("" when they were)
};

void* entryPoint(const char* symbol, std::string* missing) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  // 12000: the ABI of the _v2 memops (introduced in 11.7); CUDA 13 deprecates the unversioned lookup.
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &q);
#else
  const cudaError_t e = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn) {
    if (e != cudaSuccess) cudaGetLastError();
    *missing += std::string(missing->empty() ? "" : ", ") + symbol + " (" +
        (e != cudaSuccess                                   ? cudaGetErrorString(e)
             : q == cudaDriverEntryPointVersionNotSufficent ? "driver too old"
                                                            : "not found") +
        ")";
    return nullptr;
  }
  return fn;
}

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    r.write64 = reinterpret_cast<PFN_cuStreamWriteValue64_v11070>(entryPoint("cuStreamWriteValue64", &r.missing));
    r.wait64 = reinterpret_cast<PFN_cuStreamWaitValue64_v11070>(entryPoint("cuStreamWaitValue64", &r.missing));
    r.deviceGet = reinterpret_cast<PFN_cuDeviceGet_v2000>(entryPoint("cuDeviceGet", &r.missing));
    r.getAttribute = reinterpret_cast<PFN_cuDeviceGetAttribute_v2000>(entryPoint("cuDeviceGetAttribute", &r.missing));
    return r;
  }();
  return d;
}

bool haveEntryPoints() { return driver().missing.empty(); }

SignalRequest signalRequest() {
  SignalRequest r;
  std::string bad;
  DISTILL_CHECK_T(IpcError, parseSignalRequest(std::getenv("DISTILL_CUDA_IPC_SIGNAL"), &r, &bad),
                  "DISTILL_CUDA_IPC_SIGNAL='", bad, "': expected auto or events");
  return r;
}

bool timesRequested() {
  const char* v = std::getenv("DISTILL_CUDA_IPC_TIMES");
  return v && std::strcmp(v, "1") == 0;
}

// Runs f, timed into t when t is on.
template <typename F>
void timed(CallTimes& t, CallTimes::Call c, F&& f) {
  if (!t.on()) return f();
  const int64_t t0 = monotonicNs();
  f();
  t.add(c, monotonicNs() - t0);
}

CUdeviceptr devPtr(void* base, uint64_t offset) { return CUdeviceptr(reinterpret_cast<uintptr_t>(base) + offset); }

// Stores kReleaseAll into `count` words (one per line from `first`) on `stream` and waits: no stream of
// either end stays blocked on a word of a ring that is going away.
void releaseWords(void* first, uint64_t count, cudaStream_t stream) {
  if (count == 0) return;
  std::vector<uint64_t> lines(size_t(count * flags::kLine / sizeof(uint64_t)), 0);
  for (uint64_t i = 0; i < count; ++i) lines[size_t(i * flags::kLine / sizeof(uint64_t))] = flags::kReleaseAll;
  // Best effort (a destructor): errors are cleared, not thrown.
  if (cudaMemcpyAsync(first, lines.data(), lines.size() * sizeof(uint64_t), cudaMemcpyHostToDevice, stream) !=
          cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    cudaGetLastError();
}

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

bool memOpsUsable(int device, std::string* why) {
  const Driver& d = driver();
  if (!d.missing.empty()) {
    *why = "driver entry points missing: " + d.missing;
    return false;
  }
  CUdevice dev = 0;
  int v = 0;
  if (d.deviceGet(&dev, device) != CUDA_SUCCESS ||
      d.getAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS) {
    *why = "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS) failed on cuda:" + std::to_string(device);
    return false;
  }
  if (!v) *why = "cuda:" + std::to_string(device) + " cannot do 64-bit stream memory operations";
  return v != 0;
}

// ---- consumer ----

ConsumerBuffers::ConsumerBuffers(const SegmentImpl& seg, int student, bool response, int device)
    : seg_(seg),
      student_(student),
      response_(response),
      device_(device),
      slots_(uint64_t(seg.layout.slots)),
      times_(timesRequested()) {
  auto& ring = seg.ring(student, response);
  slotBytes_ = wire::alignUp(uint64_t(seg.capacity(response)), 256);
  const uint64_t total = flags::allocationBytes(slots_, slotBytes_);
  DeviceGuard g(device);
  DISTILL_CUDA_CALL(cudaMalloc(&base_, total), describe(), ", ", slots_, " slots of ", slotBytes_,
                    " bytes and a flag page on cuda:", device);
  DISTILL_CUDA_CALL(cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&ctl_), cudaStreamNonBlocking),
                    describe());
  // The flag page: zero words, then FlagControl, complete before the handle is published.
  std::string why;
  FlagControl c{};
  c.magic = flags::kMagic;
  c.consumerMemOps = signalRequest() == SignalRequest::kAuto && memOpsUsable(device, &why) ? 1 : 0;
  cudaDeviceProp prop{};
  DISTILL_CUDA_CALL(cudaGetDeviceProperties(&prop, device), describe());
  std::memcpy(c.consumerUuid, &prop.uuid, sizeof c.consumerUuid);
  char* page = static_cast<char*>(base_) + flags::pageOffset(slots_, slotBytes_);
  auto ctl = static_cast<cudaStream_t>(ctl_);
  DISTILL_CUDA_CALL(cudaMemsetAsync(page, 0, flags::pageBytes(slots_), ctl), describe());
  DISTILL_CUDA_CALL(cudaMemcpyAsync(page, &c, sizeof c, cudaMemcpyHostToDevice, ctl), describe());
  DISTILL_CUDA_CALL(cudaStreamSynchronize(ctl), describe());
  if (!c.consumerMemOps) {
    DISTILL_LOG(kInfo) << describe() << ": consumer offers CUDA IPC events only ("
                       << (why.empty() ? "DISTILL_CUDA_IPC_SIGNAL=events" : why) << ")";
  }
  cudaIpcMemHandle_t h;
  DISTILL_CUDA_CALL(cudaIpcGetMemHandle(&h, base_), describe());
  DISTILL_CUDA_CALL(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(&doneEvent_), cudaEventDisableTiming),
                    describe());
  ring.cudaSlotBytes = slotBytes_;
  ring.cudaDevice = device;
  std::memcpy(ring.cudaMem, &h, sizeof h);
  ring.cudaMemReady.store(1, std::memory_order_release);
  events_.reset(new void*[size_t(seg.layout.slots)]());
}

ConsumerBuffers::~ConsumerBuffers() {
  if (times_.on()) {
    DISTILL_LOG(kInfo) << describe() << ": CUDA call times (host): " << times_.summary();
  }
  seg_.ring(student_, response_).cudaMemReady.store(0, std::memory_order_release);
  DeviceGuard g(device_);
  if (base_ && ctl_) {
    // Unblock this side's stream (a written word the producer will never write, e.g. it died) and the
    // producer's (a done word) before the memory goes.
    char* page = static_cast<char*>(base_) + flags::pageOffset(slots_, slotBytes_);
    releaseWords(page + flags::writtenOffset(0), 2 * slots_, static_cast<cudaStream_t>(ctl_));
  }
  for (int i = 0; events_ && i < seg_.layout.slots; ++i)
    if (events_[i]) cudaEventDestroy(static_cast<cudaEvent_t>(events_[i]));
  if (doneEvent_) cudaEventDestroy(static_cast<cudaEvent_t>(doneEvent_));
  if (ctl_) cudaStreamDestroy(static_cast<cudaStream_t>(ctl_));
  if (base_) cudaFree(base_);
}

std::string ConsumerBuffers::describe() const {
  return distill::detail::str("segment '", seg_.name, "', ", response_ ? "response" : "request", " ring of student ",
                              student_, " (consumer)");
}

void* ConsumerBuffers::slotPtr(uint64_t slot) const { return static_cast<char*>(base_) + slot * slotBytes_; }

// Once per ring, at its first CUDA message: the producer wrote FlagControl::signal before publishing it.
void ConsumerBuffers::learnSignal() {
  FlagControl c{};
  auto ctl = static_cast<cudaStream_t>(ctl_);
  DISTILL_CUDA_CALL(cudaMemcpyAsync(&c, static_cast<char*>(base_) + flags::pageOffset(slots_, slotBytes_), sizeof c,
                                    cudaMemcpyDeviceToHost, ctl),
                    describe());
  DISTILL_CUDA_CALL(cudaStreamSynchronize(ctl), describe());
  DISTILL_CHECK_T(ProtocolError, c.signal == uint64_t(Signal::kEvents) || c.signal == uint64_t(Signal::kMemOps),
                  describe(), ": a CUDA message arrived but the producer chose no signal (flag page word ", c.signal,
                  ")");
  signal_ = Signal(c.signal);
  DISTILL_LOG(kInfo) << describe() << ": CUDA messages signalled by " << signalName(signal_);
}

bool ConsumerBuffers::waitWritten(uint64_t seq, void* stream) {
  if (signal_ == Signal::kUndecided) learnSignal();
  const uint64_t slot = seq % slots_;
  if (signal_ == Signal::kMemOps) {
    char* page = static_cast<char*>(base_) + flags::pageOffset(slots_, slotBytes_);
    timed(times_, CallTimes::kWaitWritten, [&] {
      DISTILL_CU_CALL(driver().wait64(static_cast<CUstream>(stream), devPtr(page, flags::writtenOffset(slot)),
                                      flags::writtenValue(seq), CU_STREAM_WAIT_VALUE_GEQ),
                      describe(), ", seq ", seq);
    });
    return true;
  }
  auto& ring = seg_.ring(student_, response_);
  if (!events_[slot]) {
    if (!ring.cudaEventsReady.load(std::memory_order_acquire)) return false;
    cudaIpcEventHandle_t h;
    std::memcpy(&h, seg_.ringEvents(student_, response_) + slot * wire::kCudaIpcHandleBytes, sizeof h);
    cudaEvent_t ev;
    DISTILL_CUDA_CALL(cudaIpcOpenEventHandle(&ev, h), describe(), ", slot ", slot);
    events_[slot] = ev;
  }
  timed(times_, CallTimes::kEventWait, [&] {
    DISTILL_CUDA_CALL(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(events_[slot]), 0), describe());
  });
  return true;
}

void ConsumerBuffers::readsDone(uint64_t seq, bool device, void* stream) {
  if (signal_ == Signal::kMemOps) {
    char* page = static_cast<char*>(base_) + flags::pageOffset(slots_, slotBytes_);
    timed(times_, CallTimes::kWriteDone, [&] {
      DISTILL_CU_CALL(
          driver().write64(static_cast<CUstream>(stream), devPtr(page, flags::doneOffset(slots_, seq % slots_)),
                           flags::doneValue(seq), CU_STREAM_WRITE_VALUE_DEFAULT),
          describe(), ", seq ", seq);
    });
    return;
  }
  if (!device) return;
  auto ev = static_cast<cudaEvent_t>(doneEvent_);
  timed(times_, CallTimes::kEventRecord,
        [&] { DISTILL_CUDA_CALL(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)), describe()); });
  timed(times_, CallTimes::kEventSync, [&] { DISTILL_CUDA_CALL(cudaEventSynchronize(ev), describe()); });
}

// ---- producer ----

ProducerBuffers::ProducerBuffers(const SegmentImpl& seg, int student, bool response, int device)
    : seg_(seg),
      student_(student),
      response_(response),
      device_(device),
      slots_(uint64_t(seg.layout.slots)),
      times_(timesRequested()) {
  DeviceGuard g(device);
  events_.reset(new void*[size_t(slots_)]());
  lastDeviceSeq_.reset(new uint64_t[size_t(slots_)]);
  for (uint64_t i = 0; i < slots_; ++i) lastDeviceSeq_[i] = flags::kNoDeviceMessage;
  char* handles = seg.ringEvents(student, response);
  for (int i = 0; i < seg.layout.slots; ++i) {
    cudaEvent_t ev;
    DISTILL_CUDA_CALL(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming), describe());
    events_[i] = ev;
    cudaIpcEventHandle_t h;
    DISTILL_CUDA_CALL(cudaIpcGetEventHandle(&h, ev), describe());
    std::memcpy(handles + size_t(i) * wire::kCudaIpcHandleBytes, &h, sizeof h);
  }
  seg.ring(student, response).cudaEventsReady.store(1, std::memory_order_release);
}

ProducerBuffers::~ProducerBuffers() {
  if (times_.on()) {
    DISTILL_LOG(kInfo) << describe() << ": CUDA call times (host): " << times_.summary();
  }
  seg_.ring(student_, response_).cudaEventsReady.store(0, std::memory_order_release);
  DeviceGuard g(device_);
  if (peerBase_ && ctl_ && signal_ == Signal::kMemOps) {
    // Unblock this side's stream if it waits on a done word of a consumer that will not write it.
    char* page =
        static_cast<char*>(peerBase_) + flags::pageOffset(slots_, seg_.ring(student_, response_).cudaSlotBytes);
    releaseWords(page + flags::doneOffset(slots_, 0), slots_, static_cast<cudaStream_t>(ctl_));
  }
  if (ctl_) cudaStreamDestroy(static_cast<cudaStream_t>(ctl_));
  if (peerBase_) cudaIpcCloseMemHandle(peerBase_);
  for (uint64_t i = 0; events_ && i < slots_; ++i)
    if (events_[i]) cudaEventDestroy(static_cast<cudaEvent_t>(events_[i]));
}

std::string ProducerBuffers::describe() const {
  return distill::detail::str("segment '", seg_.name, "', ", response_ ? "response" : "request", " ring of student ",
                              student_, " (producer)");
}

bool ProducerBuffers::ready() {
  if (peerBase_) return true;
  auto& ring = seg_.ring(student_, response_);
  if (!ring.cudaMemReady.load(std::memory_order_acquire)) return false;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, ring.cudaMem, sizeof h);
  DeviceGuard g(device_);
  DISTILL_CUDA_CALL(cudaIpcOpenMemHandle(&peerBase_, h, cudaIpcMemLazyEnablePeerAccess), describe(),
                    ", buffer of cuda:", ring.cudaDevice, " opened on cuda:", device_);
  chooseSignalOnce();
  return true;
}

// Reads the consumer's FlagControl, chooses, and writes the choice back before any CUDA message is published
// (the copy is synchronised, and publishing the header is a release store after it).
void ProducerBuffers::chooseSignalOnce() {
  DISTILL_CUDA_CALL(cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&ctl_), cudaStreamNonBlocking),
                    describe());
  auto ctl = static_cast<cudaStream_t>(ctl_);
  char* page = static_cast<char*>(peerBase_) + flags::pageOffset(slots_, seg_.ring(student_, response_).cudaSlotBytes);
  FlagControl c{};
  DISTILL_CUDA_CALL(cudaMemcpyAsync(&c, page, sizeof c, cudaMemcpyDeviceToHost, ctl), describe());
  DISTILL_CUDA_CALL(cudaStreamSynchronize(ctl), describe());
  SignalInputs in;
  in.request = signalRequest();
  in.pageValid = c.magic == flags::kMagic;
  in.entryPoints = haveEntryPoints();
  std::string ignored;
  in.producerMemOps = in.entryPoints && memOpsUsable(device_, &ignored);
  in.consumerMemOps = c.consumerMemOps != 0;
  cudaDeviceProp prop{};
  DISTILL_CUDA_CALL(cudaGetDeviceProperties(&prop, device_), describe());
  in.sameDevice = std::memcmp(&prop.uuid, c.consumerUuid, sizeof c.consumerUuid) == 0;
  std::string why;
  signal_ = chooseSignal(in, &why);
  const uint64_t word = uint64_t(signal_);
  DISTILL_CUDA_CALL(
      cudaMemcpyAsync(page + offsetof(FlagControl, signal), &word, sizeof word, cudaMemcpyHostToDevice, ctl),
      describe());
  DISTILL_CUDA_CALL(cudaStreamSynchronize(ctl), describe());
  DISTILL_LOG(kInfo) << describe() << ": CUDA messages signalled by " << signalName(signal_)
                     << (why.empty() ? std::string() : " (" + why + ")");
}

int ProducerBuffers::consumerDevice() const { return seg_.ring(student_, response_).cudaDevice; }

void ProducerBuffers::beginWrite(uint64_t seq, void* stream) {
  if (signal_ != Signal::kMemOps) return;
  const uint64_t slot = seq % slots_;
  const uint64_t prev = lastDeviceSeq_[slot];
  if (prev == flags::kNoDeviceMessage) return;
  char* page = static_cast<char*>(peerBase_) + flags::pageOffset(slots_, seg_.ring(student_, response_).cudaSlotBytes);
  timed(times_, CallTimes::kWaitDone, [&] {
    DISTILL_CU_CALL(driver().wait64(static_cast<CUstream>(stream), devPtr(page, flags::doneOffset(slots_, slot)),
                                    flags::doneValue(prev), CU_STREAM_WAIT_VALUE_GEQ),
                    describe(), ", seq ", seq, " waits for the reads of seq ", prev);
  });
}

void ProducerBuffers::copyIn(uint64_t seq, uint64_t offset, const void* src, size_t n, void* stream) {
  const uint64_t slot = seq % slots_;
  char* dst = static_cast<char*>(peerBase_) + slot * seg_.ring(student_, response_).cudaSlotBytes + offset;
  timed(times_, CallTimes::kCopy, [&] {
    DISTILL_CUDA_CALL(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)), describe(),
                      ", ", n, " bytes into slot ", slot);
  });
}

void ProducerBuffers::written(uint64_t seq, void* stream) {
  const uint64_t slot = seq % slots_;
  if (signal_ == Signal::kMemOps) {
    char* page =
        static_cast<char*>(peerBase_) + flags::pageOffset(slots_, seg_.ring(student_, response_).cudaSlotBytes);
    // The default write orders the copies before it (a memory barrier), so the consumer's GEQ wait sees them.
    timed(times_, CallTimes::kWriteWritten, [&] {
      DISTILL_CU_CALL(driver().write64(static_cast<CUstream>(stream), devPtr(page, flags::writtenOffset(slot)),
                                       flags::writtenValue(seq), CU_STREAM_WRITE_VALUE_DEFAULT),
                      describe(), ", seq ", seq);
    });
    lastDeviceSeq_[slot] = seq;
    return;
  }
  timed(times_, CallTimes::kEventRecord, [&] {
    DISTILL_CUDA_CALL(cudaEventRecord(static_cast<cudaEvent_t>(events_[slot]), static_cast<cudaStream_t>(stream)),
                      describe(), ", slot ", slot);
  });
}

} // namespace distill::ipc::cuda
