#pragma once

// CUDA IPC slot buffers of one ring (docs/design.md, "The segment (ipc/)", its CUDA rule). Plain C++ over the
// CUDA runtime API (and, for stream memory operations, driver entry points found through the runtime, so the
// library loads where no driver is); no CUDA types leak out (streams are passed as void*).
// Compiled only when DISTILL_CUDA; otherwise available() is false and the
// classes are never constructed.
//
// Setup per ring (fields in wire::RingHeader; the flag page in flag_page.h):
//   consumer: cudaMalloc(slots x capacity + flag page) on its device; initialise the page's FlagControl
//             (its memops capability, its device's UUID); export the handle, cudaMemReady = 1 (release) —
//             at endpoint construction.
//   producer: create one interprocess event per slot, export the handles, cudaEventsReady = 1 (release) —
//             at endpoint construction (the event path is the fallback); on its first CUDA send open the
//             consumer's buffer (once), read FlagControl, choose the Signal (chooseSignal: stream memory
//             operations when both devices can and are the same GPU) and write it into FlagControl::signal
//             before it publishes any CUDA message. Each side logs the path once.
//
// Per message, Signal::kMemOps (no host synchronisation, no event, no callback):
//   producer: [its stream waits done[slot] >= the slot's previous device message] -> copies -> its stream
//             writes written[slot] = seq + 1 -> host publishes the header (futex doorbell).
//   consumer: host sees the header -> its stream waits written[slot] >= seq + 1 -> reads (views) -> at
//             release its stream writes done[slot] = seq + 1 -> host frees the slot (ring tail).
// Per message, Signal::kEvents (the path before issue 42):
//   producer: copies on its stream, records the slot's interprocess event, publishes the header.
//   consumer: opens the producer's events (once), its stream waits on the slot's event, reads; before
//             releasing the slot records an event on its stream and synchronises it (a host wait).
//
// Where the ~150 us per message of the event path plausibly go (issue 42; one H200, round trip 301 us at
// 64 B and at 4 KiB alike, so a fixed cost per hop, not bandwidth). Not yet measured call by call; the GPU
// session times each with bench_ring_cuda / nsys:
//   1. readsDone: cudaEventRecord + cudaEventSynchronize — a host sync per message on the consumer; with
//      the default (Auto) schedule it may yield or block, and it waits for everything on the stream,
//      including the cross-process event wait below: one whole GPU hop is serialised on the host.
//   2. cudaStreamWaitEvent on an *interprocess* event (and cudaEventRecord of one on the producer): IPC
//      events are backed by a shared host semaphore, not a device word; the wait is resolved by the
//      driver, not the GPU front end, and costs far more than an ordinary event (PyTorch's per-message
//      event path, the shared GPU references §1.2).
//   3. Two contexts on one GPU without MPS are time-sliced: the producer's copy and the consumer's reads run
//      in different contexts, so every hop includes a context switch. Not removed by this path; if it
//      dominates, the 20 us target needs MPS (the ladder of the shared GPU references §1.4, step e).
//   4. The bench's own cudaStreamSynchronize per message and the futex wake of a sleeping receiver
//      (tens of us when it slept); host-side, shared by both paths.
// DISTILL_CUDA_IPC_TIMES=1 makes each end time its CUDA calls on the host and log the totals when it closes
// (call_times.h): a first split of the time without nsys.
// The memops path removes 1 and 2: the consumer's release enqueues a word write and returns, and the waits
// run in the GPU's front end on a device word.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "call_times.h"
#include "flag_page.h"

namespace distill::ipc {
struct SegmentImpl;
}

namespace distill::ipc::cuda {

// Devices visible to this process; 0 when CUDA is not compiled in or fails.
int deviceCount();
// The calling thread's current device (cudaGetDevice); 0 when that fails.
int currentDevice();

// Whether this process can use stream memory operations on `device` (entry points found and
// CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS set); false with the reason in *why otherwise.
bool memOpsUsable(int device, std::string* why);

class ConsumerBuffers {
 public:
  // Allocates and exports the slot buffer (and flag page) of ring (student, response) on `device`.
  ConsumerBuffers(const SegmentImpl& seg, int student, bool response, int device);
  ~ConsumerBuffers();
  int device() const { return device_; }
  void* slotPtr(uint64_t slot) const;
  // Makes `stream` wait until the producer's copies of message `seq` into its slot are done. False if
  // the producer set up no synchronisation (no events exported).
  bool waitWritten(uint64_t seq, void* stream);
  // After the reads of message `seq` queued on `stream` (device: it had tensors in this buffer): with
  // memops, enqueues the done word's write (no host wait; also for host-only messages, so the producer
  // never waits on a word nobody writes); with events, blocks until those reads are done (device only).
  void readsDone(uint64_t seq, bool device, void* stream);
  Signal signal() const { return signal_; }

 private:
  std::string describe() const;
  void learnSignal();

  const SegmentImpl& seg_;
  int student_;
  bool response_;
  int device_;
  uint64_t slots_;
  uint64_t slotBytes_;
  void* base_ = nullptr;
  void* ctl_ = nullptr; // private non-blocking stream for the page's one-off copies
  std::unique_ptr<void*[]> events_; // opened producer events, lazily
  void* doneEvent_ = nullptr;
  Signal signal_ = Signal::kUndecided;
  CallTimes times_;
};

class ProducerBuffers {
 public:
  // Creates and exports one interprocess event per slot on `device`.
  ProducerBuffers(const SegmentImpl& seg, int student, bool response, int device);
  ~ProducerBuffers();
  // Opens the consumer's buffer and chooses the signal if it has exported one; false if not (yet).
  bool ready();
  Signal signal() const { return signal_; }
  int device() const { return device_; }
  // Before the first copy of message `seq` (memops: its stream waits until the consumer's reads of the
  // slot's previous device message are done; events: nothing, the ring tail ordered them).
  void beginWrite(uint64_t seq, void* stream);
  // Copies n bytes (device or host memory) to offset `offset` of the slot of `seq` on `stream`.
  void copyIn(uint64_t seq, uint64_t offset, const void* src, size_t n, void* stream);
  // After the last copy, before publishing the header: memops writes the slot's written word, events
  // records the slot's event, on `stream`.
  void written(uint64_t seq, void* stream);
  int consumerDevice() const;

 private:
  std::string describe() const;
  void chooseSignalOnce();

  const SegmentImpl& seg_;
  int student_;
  bool response_;
  int device_;
  uint64_t slots_;
  void* peerBase_ = nullptr;
  void* ctl_ = nullptr;
  std::unique_ptr<void*[]> events_;
  std::unique_ptr<uint64_t[]> lastDeviceSeq_; // per slot, flags::kNoDeviceMessage until one was written
  Signal signal_ = Signal::kUndecided;
  CallTimes times_;
};

} // namespace distill::ipc::cuda
