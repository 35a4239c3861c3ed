// SlotMemory over CUDA IPC buffers, flag words and events (cuda_ipc.h); see cuda_slot_memory.h.
#include "cuda_slot_memory.h"

#include <c10/cuda/CUDAStream.h>

#include "../port.h"
#include "cuda_ipc.h"
#include "distill/core/errors.h"
#include "distill/ipc/channel.h"

namespace distill::ipc::cuda {
namespace {

void* streamOf(int device) { return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(); }

// Producer side: writes into the consumer's buffer, then signals (cuda_ipc.h: a flag word written by its
// stream, or the slot's interprocess event).
class ProducerSlotMemory final : public SlotMemory {
 public:
  ProducerSlotMemory(const RingSide& ring, const SegmentImpl& seg, int device)
      : device_(device), buffers_(seg, ring.student(), ring.response(), device) {}
  wire::Location location() const override { return wire::Location::kCuda; }
  // With stream memory operations the wait, the copies and the flag write share one stream (the endpoint
  // device's current stream), so a tensor on another device is staged through the host slot instead.
  bool accepts(const at::Tensor& t) override {
    return t.is_cuda() && buffers_.ready() && (buffers_.signal() != Signal::kMemOps || t.device().index() == device_);
  }
  void write(uint64_t seq, uint64_t offset, const at::Tensor& t) override {
    void* stream = streamOf(t.device().index());
    begin(seq, stream);
    buffers_.copyIn(seq, offset, t.data_ptr(), t.nbytes(), stream);
  }
  // The consumer waits on this signal before reading (issued before the header is published).
  void written(uint64_t seq) override {
    void* stream = streamOf(device_);
    begin(seq, stream); // a message whose device tensors were all empty still waits for the slot
    buffers_.written(seq, stream);
  }
  bool readable(uint64_t) override { return false; }
  Place place(uint64_t, uint64_t) const override { return {nullptr, -1}; }
  void readsDone(uint64_t, bool) override {}

 private:
  // Once per message, before its first copy: the slot's previous reads are done.
  void begin(uint64_t seq, void* stream) {
    if (begun_ == seq) return;
    begun_ = seq;
    buffers_.beginWrite(seq, stream);
  }

  int device_;
  uint64_t begun_ = flags::kNoDeviceMessage;
  ProducerBuffers buffers_;
};

// Consumer side: owns the buffer, waits for the producer's signal.
class ConsumerSlotMemory final : public SlotMemory {
 public:
  ConsumerSlotMemory(const RingSide& ring, const SegmentImpl& seg, int device)
      : slots_(uint64_t(ring.slots())), buffers_(seg, ring.student(), ring.response(), device) {}
  wire::Location location() const override { return wire::Location::kCuda; }
  bool accepts(const at::Tensor&) override { return false; }
  void write(uint64_t, uint64_t, const at::Tensor&) override {}
  void written(uint64_t) override {}
  bool readable(uint64_t seq) override { return buffers_.waitWritten(seq, streamOf(buffers_.device())); }
  Place place(uint64_t seq, uint64_t offset) const override {
    return {static_cast<char*>(buffers_.slotPtr(seq % slots_)) + offset, buffers_.device()};
  }
  void readsDone(uint64_t seq, bool device) override { buffers_.readsDone(seq, device, streamOf(buffers_.device())); }

 private:
  uint64_t slots_;
  ConsumerBuffers buffers_;
};

} // namespace

DeviceSlotMemory makeSlotMemory(const Port& port, const std::vector<RingSide>& in, const std::vector<RingSide>& out,
                                const EndpointOptions& options) {
  DeviceSlotMemory m;
  if (options.cudaIpc == CudaIpc::kOff) return m;
  const bool usable = options.cudaDevice >= 0 && options.cudaDevice < deviceCount();
  DISTILL_CHECK_T(IpcError, usable || options.cudaIpc != CudaIpc::kOn, port.describeSelf(),
                  ": transport.cuda_ipc=on but device ", options.cudaDevice, " is not usable (", deviceCount(),
                  " CUDA devices visible)");
  if (!usable) return m;
  for (const auto& r : in) m.in.push_back(std::make_unique<ConsumerSlotMemory>(r, port.seg(), options.cudaDevice));
  for (const auto& r : out) m.out.push_back(std::make_unique<ProducerSlotMemory>(r, port.seg(), options.cudaDevice));
  return m;
}

} // namespace distill::ipc::cuda
