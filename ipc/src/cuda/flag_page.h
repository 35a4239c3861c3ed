#pragma once

// The flag page of a CUDA ring (issue 42) and the choice of how a CUDA message
// is signalled. Pure C++ (no CUDA, no torch): compiled on every machine and
// unit tested on CPUs (tests/ipc/flag_page_test.cpp); cuda_ipc.cpp uses it.
//
// Where the page lives: in the consumer's one cudaMalloc of the ring, right
// after its slot buffers (offset slots x cudaSlotBytes), so the one IPC handle
// of wire::RingHeader::cudaMem exports it with the slots and nothing in the
// segment (wire.h) changes: both sides derive its place from the ring's slot
// count and cudaSlotBytes.
//
//   page + 0                     FlagControl: written once by each side (cudaMemcpy), read once by the other
//   page + writtenOffset(i)      written word of slot i: the producer's stream writes writtenValue(seq)
//                                after its copies of message seq (cuStreamWriteValue64)
//   page + doneOffset(slots, i)  done word of slot i: the consumer's stream writes doneValue(seq) after
//                                its reads of message seq (cuStreamWriteValue64)
//
// Every word on its own 64-byte line; all values are 64-bit and compared by the
// driver's cyclic >= (CU_STREAM_WAIT_VALUE_GEQ), so they only ever grow.
//
// Who waits on what:
//   consumer, readable(seq): its stream waits written[seq % slots] >= writtenValue(seq)
//   producer, before the first copy of message seq into a slot whose last
//   device message was `prev`: its stream waits done[slot] >= doneValue(prev)
//
// kReleaseAll is stored into every word when an end goes away (its destructor),
// so that no stream stays blocked on a word nobody will write any more.

#include <cstddef>
#include <cstdint>
#include <string>

namespace distill::ipc::cuda {

namespace flags {

constexpr uint64_t kLine = 64; // one word per cache line
constexpr uint64_t kControlBytes = 256; // FlagControl, padded
constexpr uint64_t kAlign = 256; // the page starts on a 256-byte boundary (cudaMalloc's slot rounding)
constexpr uint64_t kMagic = 0x64666c6167763031ULL; // "dflagv01": the page's own version; bump with FlagControl
constexpr uint64_t kReleaseAll = uint64_t(1) << 62; // >= every value a ring reaches (GEQ is cyclic: stay < 2^63)
constexpr uint64_t kNoDeviceMessage = ~uint64_t(0); // producer: no device message in this slot yet

// Offset of the flag page in the ring's CUDA allocation (slot i at i x slotBytes before it).
constexpr uint64_t pageOffset(uint64_t slots, uint64_t slotBytes) {
  return (slots * slotBytes + kAlign - 1) / kAlign * kAlign;
}
// Offsets inside the page.
constexpr uint64_t writtenOffset(uint64_t slot) { return kControlBytes + slot * kLine; }
constexpr uint64_t doneOffset(uint64_t slots, uint64_t slot) { return kControlBytes + (slots + slot) * kLine; }
// Bytes of the page (a multiple of kAlign).
constexpr uint64_t pageBytes(uint64_t slots) {
  return (kControlBytes + 2 * slots * kLine + kAlign - 1) / kAlign * kAlign;
}
// The whole allocation: slots, then the page.
constexpr uint64_t allocationBytes(uint64_t slots, uint64_t slotBytes) {
  return pageOffset(slots, slotBytes) + pageBytes(slots);
}

// Values: 0 is "never written", so message seq is seq + 1.
constexpr uint64_t writtenValue(uint64_t seq) { return seq + 1; }
constexpr uint64_t doneValue(uint64_t seq) { return seq + 1; }

} // namespace flags

// How a ring's CUDA messages are signalled; chosen once per ring by the
// producer (it sees both devices), stored in FlagControl::signal.
enum class Signal : uint64_t {
  kUndecided = 0, // the producer has not sent a CUDA message yet
  kEvents = 1, // interprocess CUDA events (the path before issue 42); the fallback
  kMemOps = 2, // the flag page's words by stream memory operations
};
const char* signalName(Signal s);

// The page's first bytes (device memory; copied whole with cudaMemcpy).
struct FlagControl {
  uint64_t magic; // flags::kMagic once the consumer initialised the page
  uint32_t consumerMemOps; // 1: the consumer's device and driver can do 64-bit stream memory ops
  uint32_t reserved;
  uint8_t consumerUuid[16]; // the consumer's device (cudaDeviceProp::uuid)
  uint8_t pad0[32];
  uint64_t signal; // at 64: Signal, written by the producer before its first CUDA message
  uint8_t pad1[56];
};
static_assert(sizeof(FlagControl) == 128 && sizeof(FlagControl) <= flags::kControlBytes &&
                  offsetof(FlagControl, signal) == 64,
              "FlagControl layout");

// What DISTILL_CUDA_IPC_SIGNAL asks for (unset, "" or "auto": kAuto;
// "events": kEvents, e.g. to compare the two paths or to rule the new one out).
enum class SignalRequest { kAuto, kEvents };
// false (and *bad holds the value) for anything else.
bool parseSignalRequest(const char* value, SignalRequest* out, std::string* bad);

// What the producer knows when it chooses, and the choice.
struct SignalInputs {
  SignalRequest request = SignalRequest::kAuto; // this process's DISTILL_CUDA_IPC_SIGNAL
  bool pageValid = false; // FlagControl::magic == kMagic
  bool entryPoints = false; // cuStreamWriteValue64/cuStreamWaitValue64 found through the runtime
  bool producerMemOps = false; // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS on the producer's device
  bool consumerMemOps = false; // FlagControl::consumerMemOps
  bool sameDevice = false; // the two ends' device UUIDs are equal
};
// kMemOps when every input allows it, else kEvents with the first reason in *why.
Signal chooseSignal(const SignalInputs& in, std::string* why);

} // namespace distill::ipc::cuda
