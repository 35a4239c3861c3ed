// The producing side of an endpoint: lays a message out in the next free slot
// of an out ring (send: copies; allocate + publish: tensors built in the slot),
// then publishes its header. See channel_core.h.
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>

#include "channel_core.h"
#include "distill/core/errors.h"

namespace distill::ipc::detail {
namespace {

wire::DType toWire(at::ScalarType t, const std::string& name) {
  switch (t) {
    case at::kInt:
      return wire::DType::kInt32;
    case at::kLong:
      return wire::DType::kInt64;
    case at::kFloat:
      return wire::DType::kFloat32;
    case at::kHalf:
      return wire::DType::kFloat16;
    case at::kBFloat16:
      return wire::DType::kBFloat16;
    case at::kBool:
      return wire::DType::kBool;
    case at::kShort:
      return wire::DType::kInt16;
    default:
      DISTILL_THROW(IpcError, "tensor '", name, "': dtype ", c10::toString(t),
                    " cannot be sent (int32, int64, int16, float32, float16, bfloat16, bool)");
  }
}

} // namespace

// Tensor i of items into t, at the next 64-byte aligned offset of its location
// (used[location] bytes taken so far); IpcError if it does not fit.
void ChannelCore::planTensor(int r, const Tag& tag, const PlanItem* items, size_t i, wire::TensorDesc& t,
                             uint64_t* used) {
  const auto& s = items[i];
  const std::string& name = *s.name;
  DISTILL_CHECK_T(IpcError, !name.empty() && name.size() < size_t(wire::kNameBytes), "tensor name '", name,
                  "' must have 1..", wire::kNameBytes - 1, " characters");
  for (size_t j = 0; j < i; ++j)
    DISTILL_CHECK_T(IpcError, *items[j].name != name, "two tensors named '", name, "' in one message");
  DISTILL_CHECK_T(IpcError, s.shape.size() <= size_t(wire::kMaxDims), "tensor '", name, "' has ", s.shape.size(),
                  " dims; at most ", wire::kMaxDims, " can be sent");
  std::memcpy(t.name, name.data(), name.size());
  const auto dt = toWire(s.dtype, name);
  t.dtype = uint32_t(dt);
  t.ndim = uint32_t(s.shape.size());
  uint64_t numel = 1;
  for (size_t d = 0; d < s.shape.size(); ++d) {
    DISTILL_CHECK_T(IpcError, s.shape[d] >= 0, "tensor '", name, "': negative dim ", s.shape[d]);
    t.shape[d] = s.shape[d];
    numel *= uint64_t(s.shape[d]);
  }
  t.nbytes = numel * uint64_t(wire::itemSize(dt));
  t.location = uint32_t(s.location);
  uint64_t& u = used[s.location == wire::Location::kHost ? 0 : 1];
  t.offset = wire::alignUp(u, wire::kPayloadAlign);
  u = t.offset + t.nbytes;
  const int64_t cap = out_[size_t(r)].capacity();
  if (u > uint64_t(cap))
    DISTILL_THROW(IpcError, at(tag.step, tag.accStep), port_.describeSelf(), ": tensor '", name, "' of ", t.nbytes,
                  " bytes does not fit a ", role_.outName, " slot: the message needs ", u, " bytes, the slot holds ",
                  cap, " bytes; raise ", role_.capacityKey, " to at least ", wire::alignUp(u, wire::kPayloadAlign),
                  " (segment '", port_.seg().name, "')");
}

// The header of a message of `count` tensors for out ring r; tensors at
// 64-byte aligned offsets; IpcError if they do not fit.
wire::SlotHeader ChannelCore::plan(int r, const Tag& tag, MsgKind kind, const PlanItem* items, size_t count,
                                   const std::string& errorText) {
  wire::SlotHeader h{};
  h.seq = tag.seq;
  h.step = tag.step;
  h.accStep = tag.accStep;
  h.kind = uint16_t(kind);
  h.senderRank = port_.rank();
  h.ntensors = uint32_t(count);
  if (!errorText.empty()) {
    const std::string fitted = wire::fitErrorText(errorText);
    std::memcpy(h.errorText, fitted.data(), fitted.size()); // h is zeroed: the NUL follows
  }
  uint64_t used[2] = {0, 0}; // host payload, device slot memory
  for (size_t i = 0; i < count; ++i) planTensor(r, tag, items, i, h.tensors[i], used);
  return h;
}

// Waits for a free slot in out ring r; returns its ring sequence.
uint64_t ChannelCore::acquire(int r, const Tag& tag, Deadline deadline) {
  auto& ring = out_[size_t(r)];
  if (ring.canWrite()) return ring.writeSeq(); // the common case: no clock, no wait bookkeeping
  const WaitDesc d{role_.outSlot, peerOf(r), tag};
  const auto start = Clock::now();
  if (!port_.waitUntil([&] { return ring.canWrite(); }, d, {peerOf(r)}, true, deadline))
    DISTILL_THROW(TimeoutError, at(tag.step, tag.accStep, wire::waitName(uint32_t(d.what))), port_.describeSelf(),
                  ": no free ", role_.outName, " slot after ", toMs(Clock::now() - start), " ms (all ", ring.slots(),
                  " slots held by ", port_.describeProcess(peerOf(r)), ", seq ", tag.seq, ", segment '",
                  port_.seg().name, "')");
  return ring.writeSeq();
}

// Seals the header into the acquired slot of out ring r and publishes it.
void ChannelCore::commit(int r, wire::SlotHeader& hdr) {
  auto& ring = out_[size_t(r)];
  wire::sealHeader(hdr);
  std::memcpy(ring.slot(ring.writeSeq()), &hdr, wire::headerBytes(hdr));
  ring.publish(peerOf(r));
  port_.recorder().complete(role_.sendOp, port_.seg().process(peerOf(r)).rank.load(std::memory_order_relaxed), hdr.step,
                            hdr.accStep, hdr.seq, 0, kindLabel(hdr.kind));
}

void ChannelCore::send(int r, const OutMessage& msg, Deadline deadline) {
  guarded([&] {
    DISTILL_CHECK_T(IpcError, pending_ < 0, port_.describeSelf(), ": send() while an allocate() is not published");
    const size_t n = msg.tensors.size();
    DISTILL_CHECK_T(IpcError, n <= size_t(wire::kMaxTensors), port_.describeSelf(), ": a message holds at most ",
                    wire::kMaxTensors, " tensors, got ", n);
    // Fixed arrays, not vectors: this is the per-message path.
    std::array<at::Tensor, wire::kMaxTensors> src;
    std::array<PlanItem, wire::kMaxTensors> items;
    bool anyDevice = false;
    for (size_t i = 0; i < n; ++i) {
      const auto& [name, t] = msg.tensors[i];
      DISTILL_CHECK_T(IpcError, t.defined(), "tensor '", name, "' is undefined");
      // A tensor the ring's device slot memory takes goes there; anything
      // else is staged through the host slot.
      const bool device = !device_.out.empty() && device_.out[size_t(r)]->accepts(t);
      const at::Tensor& staged = (t.is_cuda() && !device) ? (src[i] = t.cpu()) : t;
      src[i] = staged.is_contiguous() ? staged : staged.contiguous();
      const auto where = device ? device_.out[size_t(r)]->location() : wire::Location::kHost;
      items[i] = PlanItem{&name, src[i].scalar_type(), src[i].sizes(), where};
      anyDevice = anyDevice || device;
    }
    wire::SlotHeader h = plan(r, msg.tag, msg.kind, items.data(), n, msg.errorText);
    DISTILL_CHECK_T(IpcError, msg.vocab >= 0 && msg.vocab <= int64_t(UINT32_MAX), "vocabulary size ", msg.vocab,
                    " does not fit the message header (uint32)");
    h.vocab = uint32_t(msg.vocab);
    h.teacher = msg.teacher;
    h.answer = static_cast<uint8_t>(msg.answer);
    const uint64_t seq = acquire(r, msg.tag, deadline);
    for (size_t i = 0; i < n; ++i) {
      const auto& d = h.tensors[i];
      if (d.nbytes > 0) outMemory(r, wire::Location(d.location)).write(seq, d.offset, src[i]);
    }
    if (anyDevice) device_.out[size_t(r)]->written(seq);
    commit(r, h);
  });
}

std::vector<at::Tensor> ChannelCore::allocate(int r, const Tag& tag, MsgKind kind, const std::vector<TensorSpec>& specs,
                                              Deadline deadline) {
  return guarded([&] {
    DISTILL_CHECK_T(IpcError, pending_ < 0, port_.describeSelf(), ": allocate() while another is not published");
    DISTILL_CHECK_T(IpcError, specs.size() <= size_t(wire::kMaxTensors), port_.describeSelf(),
                    ": a message holds at most ", wire::kMaxTensors, " tensors, got ", specs.size());
    std::array<PlanItem, wire::kMaxTensors> items;
    for (size_t i = 0; i < specs.size(); ++i) items[i] = PlanItem{&specs[i].name, specs[i].dtype, specs[i].shape};
    wire::SlotHeader h = plan(r, tag, kind, items.data(), specs.size(), {});
    const uint64_t seq = acquire(r, tag, deadline);
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < specs.size(); ++i)
      out.push_back(at::from_blob(outHost_[size_t(r)].data(seq, h.tensors[i].offset), specs[i].shape,
                                  at::TensorOptions().dtype(specs[i].dtype)));
    pendingHdr_ = h;
    pending_ = r;
    return out;
  });
}

void ChannelCore::publish(int r) {
  DISTILL_CHECK_T(IpcError, pending_ == r, port_.describeSelf(), ": publish() without a matching allocate()");
  pending_ = -1;
  guarded([&] { commit(r, pendingHdr_); });
}

} // namespace distill::ipc::detail
