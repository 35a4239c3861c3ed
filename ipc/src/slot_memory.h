#pragma once

// Where the tensors of a message live while it is in a ring slot, as one side
// of one ring sees it. Every slot has host memory (its payload in the segment,
// HostSlotMemory); a ring may also have device memory (CUDA IPC buffers,
// cuda/cuda_slot_memory.cpp). The header of each tensor records which one
// holds it (wire::Location) and at what offset, so the channel code only asks
// the memory of that location:
//
//   producer: accepts(t)? -> write(seq, offset, t) for each tensor -> written(seq)
//             -> publish the header (RingSide::publish)
//   consumer: readable(seq) -> place(seq, offset) for each tensor (views) ->
//             readsDone(seq, device) -> release the slot (RingSide::release)
//
// `seq` is the ring sequence of the message (its slot is seq % slots). An
// instance is used by one side only: the producer calls the producer methods,
// the consumer the consumer methods.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "ring.h"

namespace distill::ipc {

struct EndpointOptions;
class Port;

class SlotMemory {
 public:
  virtual ~SlotMemory() = default;
  virtual wire::Location location() const = 0;

  // ---- producer ----
  // True if `t` can be written here as it is (no staging copy).
  virtual bool accepts(const at::Tensor& t) = 0;
  // Copies the bytes of contiguous `t` to `offset` of the slot of `seq`.
  virtual void write(uint64_t seq, uint64_t offset, const at::Tensor& t) = 0;
  // After the last write to the slot of `seq`, before its header is published.
  virtual void written(uint64_t seq) = 0;

  // ---- consumer ----
  // Orders this side's later reads of the slot of `seq` after the producer's
  // writes. False if it cannot (the producer set up no synchronisation).
  virtual bool readable(uint64_t seq) = 0;
  // Where the bytes at `offset` of the slot of `seq` are: data and device
  // (-1: host) of the tensor view made on them.
  struct Place {
    void* data;
    int device;
  };
  virtual Place place(uint64_t seq, uint64_t offset) const = 0;
  // Before the slot of `seq` is released to the producer, on every release
  // (device: the message had tensors in this memory). Orders this side's reads
  // queued so far before the producer's next writes into the slot: by blocking
  // until they are done (host memory: nothing to do; CUDA events), or by
  // enqueueing a device-side signal the producer's stream waits on (CUDA
  // stream memory operations), which is why it is also called for messages
  // without device tensors.
  virtual void readsDone(uint64_t seq, bool device) = 0;
};

// The payload of the ring's slots in the segment (host memory).
class HostSlotMemory final : public SlotMemory {
 public:
  explicit HostSlotMemory(const RingSide& ring) : ring_(&ring) {}
  wire::Location location() const override { return wire::Location::kHost; }
  bool accepts(const at::Tensor& t) override { return !t.is_cuda(); }
  void write(uint64_t seq, uint64_t offset, const at::Tensor& t) override;
  void written(uint64_t) override {}
  bool readable(uint64_t) override { return true; } // the header's acquire load ordered the reads
  Place place(uint64_t seq, uint64_t offset) const override { return {ring_->payload(seq) + offset, -1}; }
  void readsDone(uint64_t, bool) override {}
  uint8_t* data(uint64_t seq, uint64_t offset) const { return ring_->payload(seq) + offset; }

 private:
  const RingSide* ring_;
};

// The device slot memory of each of an endpoint's rings (`in`: rings it
// consumes, `out`: rings it produces into), as transport.cuda_ipc and the
// endpoint's device say: empty vectors when none is used. IpcError for
// cuda_ipc=on without a usable device (or without CUDA compiled in). The one
// place that chooses the CUDA implementation.
struct DeviceSlotMemory {
  std::vector<std::unique_ptr<SlotMemory>> in, out;
};
DeviceSlotMemory makeDeviceSlotMemory(const Port& port, const std::vector<RingSide>& in,
                                      const std::vector<RingSide>& out, const EndpointOptions& options);

} // namespace distill::ipc
