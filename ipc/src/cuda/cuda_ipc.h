#pragma once

// CUDA IPC slot buffers of one ring (docs/design.md, "The segment (ipc/)", its CUDA rule). Plain C++ over the
// CUDA runtime API; no CUDA types leak out (streams are passed as void*).
// Compiled only when DISTILL_CUDA; otherwise available() is false and the
// classes are never constructed.
//
// Protocol per ring (fields in wire::RingHeader):
//   consumer: cudaMalloc(slots x capacity) on its device, export the handle,
//             cudaMemReady = 1 (release) — at endpoint construction;
//             on a CUDA message: open the producer's events (once), make its
//             stream wait on the slot's event, read; before releasing the slot
//             record an event on its stream and synchronise it (reads done).
//   producer: create one interprocess event per slot, export the handles,
//             cudaEventsReady = 1 (release) — at endpoint construction;
//             on the first CUDA send: open the consumer's buffer (once); copy on
//             its current stream into the slot buffer, record the slot's event,
//             then publish the header. The slot is reused only after the
//             consumer released it (ring tail), i.e. after its reads completed.

#include <cstddef>
#include <cstdint>
#include <memory>

namespace distill::ipc {
struct SegmentImpl;
}

namespace distill::ipc::cuda {

// Devices visible to this process; 0 when CUDA is not compiled in or fails.
int deviceCount();
// The calling thread's current device (cudaGetDevice); 0 when that fails.
int currentDevice();

class ConsumerBuffers {
 public:
  // Allocates and exports the slot buffer of ring (student, response) on `device`.
  ConsumerBuffers(const SegmentImpl& seg, int student, bool response, int device);
  ~ConsumerBuffers();
  int device() const { return device_; }
  void* slotPtr(uint64_t slot) const;
  // Makes `stream` wait until the producer's copy into `slot` is done. False if
  // the producer has exported no events.
  bool waitWritten(uint64_t slot, void* stream);
  // Blocks until the work queued on `stream` so far (reads of the slot) is done.
  void readsDone(void* stream);

 private:
  const SegmentImpl& seg_;
  int student_;
  bool response_;
  int device_;
  void* base_ = nullptr;
  std::unique_ptr<void*[]> events_; // opened producer events, lazily
  void* doneEvent_ = nullptr;
};

class ProducerBuffers {
 public:
  // Creates and exports one interprocess event per slot on `device`.
  ProducerBuffers(const SegmentImpl& seg, int student, bool response, int device);
  ~ProducerBuffers();
  // Opens the consumer's buffer if it has exported one; false if not (yet).
  bool ready();
  // Copies n bytes (device or host memory) to offset `offset` of `slot` on `stream`.
  void copyIn(uint64_t slot, uint64_t offset, const void* src, size_t n, void* stream);
  // Records the slot's event on `stream`; call before publishing the header.
  void recordWritten(uint64_t slot, void* stream);
  int consumerDevice() const;

 private:
  const SegmentImpl& seg_;
  int student_;
  bool response_;
  int device_;
  void* peerBase_ = nullptr;
  std::unique_ptr<void*[]> events_;
};

} // namespace distill::ipc::cuda
