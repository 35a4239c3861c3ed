#pragma once

// The wire format of the shared-memory segment: every layout constant, the
// magics, the layout version and the checksums live here and nowhere else.
// Plain structs (no Boost, no torch, no CUDA), so this header and wire.cpp can
// be compiled alone (sanitizers, libFuzzer). Everything in the segment is
// addressed by byte offsets from the segment start, never by pointers.
//
// Segment map (all offsets 64-byte aligned, recorded in the ControlBlock):
//
//   0                      ControlBlock            (kControlBytes)
//   processTableOffset     ProcessEntry[numStudents + numTeachers]   students 0..S-1, then the
//                          teachers S..S+K-1 (the process index is the local rank)
//   statusOffset           (numStudents + numTeachers) x StatusArea: what each student published of its
//                          training (Client::publishStatus; distill-run's status line)
//   recorderOffset         (numStudents + numTeachers) x RecorderArea (kRecorderBytesPerProcess): the
//                          flight recorder, one event ring per process, written only by
//                          the owning process (ipc/src/recorder.h)
//   configOffset           (numStudents + numTeachers) x ConfigArea (kConfigBytesPerProcess): what each
//                          process published of its config at attach (admission compares them)
//   ringsOffset            per student i: request ring (i -> its teacher), then response ring
//                          (its teacher -> i); each ring = RingHeader + slots x slot stride
//   slot                   SlotHeader (kSlotHeaderBytes) + payload (capacity rounded up to 64)
//
// Any change to a struct below or to the meaning of a field bumps kLayoutVersion.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace distill::ipc::wire {

constexpr uint64_t kSegmentMagic = 0x314D48534C495444ull; // "DTILSHM1", little endian
// 3: checksum over the used prefix; 4: teacherMaxRestarts; 5: recorder; 6: config areas and
// the teacher's admission refusal (issue 14 item 13); 7: ProcessEntry::endedNs; 8: status areas;
// 9: ControlBlock::teacherCacheHitPermille; 10: CRC32C checksums; 11: a teacher pool (numTeachers,
// the per-teacher TeacherState array instead of one teacher's fields); 12: TeacherState's cache
// counters (lookups, hits, stored tokens and bytes, full) instead of cacheHitPermille, and
// ControlBlock::stallTimeoutMs (transport.stall_timeout_s); 13: SlotHeader::vocab (the teacher's
// vocabulary) and the status value kStatusTruncatedMass; 14: RingHeader::failedSeq, TeacherState::gaveUp and
// ControlBlock::gaveUpText (a teacher whose forward raised leaves its requests for the next incarnation, and
// one that fails again on the same request gives up), and the status values kStatusMasked and
// kStatusSkipped; 15: SlotHeader::answer (the answer kind of a response, core/answer_kinds.h) in what
// was the upper half of SlotHeader::kind, now 16 bits
constexpr uint32_t kLayoutVersion = 16;
constexpr uint32_t kSlotMagic = 0x544F4C53u; // "SLOT"

constexpr int kMaxTensors = 4; // tensors per message
constexpr int kMaxDims = 8; // dimensions per tensor
constexpr int kNameBytes = 32; // tensor name incl. NUL
constexpr int kJobIdBytes = 64; // job id incl. NUL
constexpr int kErrorTextBytes = 456; // error message text incl. NUL
constexpr int kMaxStudents = 255; // local students per node
constexpr int kMaxTeachers = 16; // local teachers per node (teacher.procs)
constexpr int kMaxSlots = 1024; // slots per ring
constexpr int64_t kMaxPayloadBytes = int64_t(1) << 40;
constexpr size_t kCacheLine = 64;
constexpr size_t kPayloadAlign = 64; // every tensor offset in a payload is a multiple of this
constexpr size_t kControlBytes = 4096;
constexpr size_t kRecorderBytesPerProcess = 16384;
constexpr size_t kConfigBytesPerProcess = 32768; // ConfigArea: a config's description (~3 KiB + the trainer's keys)
constexpr int kRefusalBytes = 2048; // ControlBlock::refusal incl. NUL
constexpr int kGaveUpTextBytes = 512; // ControlBlock::gaveUpText incl. NUL (holds a fitErrorText)
static_assert(kGaveUpTextBytes >= kErrorTextBytes, "gaveUpText holds a fitErrorText");

constexpr size_t alignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---- Enumerations (stored as uint32_t; SlotHeader::kind as uint16_t) ---------------------------

enum class Kind : uint32_t { kRequest = 1, kResponse = 2, kError = 3, kFinish = 4 };
enum class DType : uint32_t { kInt32 = 1, kInt64 = 2, kFloat32 = 3, kFloat16 = 4, kBFloat16 = 5, kBool = 6, kInt16 = 7 };
enum class Location : uint32_t { kHost = 0, kCuda = 1 };
enum class ProcState : uint32_t {
  kEmpty = 0, // never attached
  kAttached = 1, // attached, not yet admitted / idle
  kServing = 2, // teacher: admitted all students and serving
  kWaiting = 3, // sleeping in a wait; ProcessEntry::wait* say on what
  kBusy = 4, // working (computing a batch / a step)
  kFinished = 5, // detached cleanly
  kDead = 6, // detached abnormally (exception) or declared dead by the launcher
};
// What a process waits on (ProcessEntry::waitWhat).
enum class WaitWhat : uint32_t {
  kNone = 0,
  kAdmission = 1, // student: teacher admission; teacher: all students attached
  kRequest = 2, // teacher: a request from any student
  kResponse = 3, // student: a response from the teacher
  kRequestSlot = 4, // student: a free slot in its request ring
  kResponseSlot = 5, // teacher: a free slot in a student's response ring
};

int64_t itemSize(DType d); // bytes per element, 0 if unknown
const char* dtypeName(uint32_t d);
// `text` as SlotHeader::errorText holds it (kErrorTextBytes with the NUL): whole
// when it fits; else cut at a UTF-8 character boundary and ended by
// kErrorTextCut (the teacher logs the whole text when it sends an error).
inline constexpr const char* kErrorTextCut = " ... (cut to fit the answer; the teacher's log has it whole)";
std::string fitErrorText(const std::string& text);
const char* kindName(uint32_t k);
const char* waitName(uint32_t w);
const char* stateName(uint32_t s);

// ---- Slot header --------------------------------------------------------------------------------

struct TensorDesc {
  char name[kNameBytes]; // NUL-terminated, non-empty
  uint32_t dtype; // DType
  uint32_t ndim; // 0 .. kMaxDims
  int64_t shape[kMaxDims]; // dims >= 0; entries >= ndim are 0
  uint64_t nbytes; // product(shape) * itemSize(dtype)
  uint64_t offset; // into the slot payload (host) or the slot's CUDA buffer; % kPayloadAlign == 0
  uint32_t location; // Location
  uint32_t reserved;
};
static_assert(sizeof(TensorDesc) == 128, "TensorDesc layout");
static_assert(offsetof(TensorDesc, shape) == 40 && offsetof(TensorDesc, offset) == 112, "TensorDesc layout");

struct SlotHeader {
  uint32_t magic; // kSlotMagic
  uint32_t checksum; // headerChecksum(): over the first headerBytes() bytes, this field as 0
  uint64_t seq; // message sequence number (Tag::seq)
  int64_t step; // training step (Tag::step)
  int64_t accStep; // gradient-accumulation index (Tag::accStep)
  uint16_t kind; // Kind
  uint8_t answer; // kind == kResponse: its AnswerKind (core/answer_kinds.h), checked by the student; else 0
  uint8_t reserved;
  int32_t senderRank; // global rank of the sender
  uint32_t ntensors; // 0 .. kMaxTensors
  uint32_t vocab; // kind == kResponse: the teacher's vocabulary size (its logits' width), 0 = not stated
  uint64_t teacher; // kind == kResponse: the teacher's fingerprint (teacher/server.h), 0 = not stated
  TensorDesc tensors[kMaxTensors];
  char errorText[kErrorTextBytes]; // kind == kError: NUL-terminated message; else zeros
};
static_assert(sizeof(SlotHeader) == 1024, "SlotHeader layout");
static_assert(offsetof(SlotHeader, tensors) == 56, "SlotHeader layout");
constexpr size_t kSlotHeaderBytes = sizeof(SlotHeader);

// The part of a header that carries the message: the fixed fields and the
// first `ntensors` descriptors, plus the error text for kind kError (1 KiB in
// all then). Only this prefix is written, copied and checksummed; the bytes
// after it are not part of the message and are never read (a consumer copies
// the prefix into a zeroed header). 184 bytes for a one-tensor message: the
// cross-core traffic of a header is 3 cache lines instead of 16.
// `ntensors` above kMaxTensors counts as kMaxTensors (validation rejects it).
inline size_t headerBytes(uint32_t kind, uint32_t ntensors) {
  if (kind == uint32_t(Kind::kError)) return sizeof(SlotHeader);
  return offsetof(SlotHeader, tensors) +
      (ntensors < uint32_t(kMaxTensors) ? ntensors : uint32_t(kMaxTensors)) * sizeof(TensorDesc);
}
inline size_t headerBytes(const SlotHeader& h) { return headerBytes(h.kind, h.ntensors); }

// Checksum over the first headerBytes(h) bytes with the checksum field taken as
// 0 (64-bit multiply-xorshift over words; cheap enough to run on every message).
uint32_t headerChecksum(const SlotHeader& h);
inline void sealHeader(SlotHeader& h) {
  h.magic = kSlotMagic;
  h.checksum = 0;
  h.checksum = headerChecksum(h);
}

// Validates everything a consumer relies on before building a tensor on the
// header (its first headerBytes(h) bytes; the error text only for kind kError): magic, checksum, kind, ntensors, names,
// dtypes, ndim, dims, nbytes == product(shape) * itemsize (overflow-checked), alignment, bounds against `slotCapacity`
// (payload bytes), no overlap, error text terminated. On failure returns false and, if `why` is given, names the field
// and its values.
bool validateHeader(const SlotHeader& h, size_t slotCapacity, std::string* why);

// ---- Control block and process table -------------------------------------------------------------
// Atomics here are lock-free and address-free (static_asserts below), so they
// work across processes mapping the segment at different addresses.

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<int64_t>::is_always_lock_free,
              "shared-memory atomics must be lock free");

struct ControlBlock {
  // Immutable after creation (covered by controlChecksum). The creator writes
  // everything, then stores `magic` with release; attachers load it with acquire.
  std::atomic<uint64_t> magic; // kSegmentMagic once initialised
  uint32_t layoutVersion; // kLayoutVersion of the creator
  uint32_t controlChecksum; // controlChecksum() of the immutable fields
  char jobId[kJobIdBytes];
  int32_t numStudents;
  int32_t slots;
  int64_t maxRequestBytes; // payload capacity of a request slot
  int64_t maxResponseBytes; // payload capacity of a response slot
  int32_t heartbeatMs;
  int32_t creatorPid;
  uint64_t incarnation; // random per creation: a recreated segment differs
  uint64_t totalBytes;
  uint64_t processTableOffset;
  uint64_t recorderOffset;
  uint64_t recorderBytesPerProcess;
  uint64_t ringsOffset;
  uint64_t requestSlotStride; // kSlotHeaderBytes + aligned request capacity
  uint64_t responseSlotStride;
  uint64_t ringPairStride; // bytes per student (request ring + response ring)
  uint64_t configOffset; // ConfigArea of process 0; one per process
  uint64_t configBytesPerProcess; // kConfigBytesPerProcess
  uint64_t statusOffset; // StatusArea of process 0; one per process
  int32_t numTeachers; // teacher processes of the node (teacher.procs), 1..kMaxTeachers
  int32_t reserved32;
  int64_t stallTimeoutMs; // a live peer without heartbeats is lost after this long (transport.stall_timeout_s)
  uint64_t reserved[3];

  // Mutable.
  alignas(kCacheLine) std::atomic<uint32_t> abort; // nonzero: everyone stops waiting (launcher)
  std::atomic<uint32_t> stopRequested; // nonzero: the launcher got SIGINT/SIGTERM; students
                                       // should checkpoint and leave (launcher stores, release)
  std::atomic<int32_t> teacherMaxRestarts; // the launcher restarts each dead teacher this many
                                           // times (teacher.max_restarts; launcher stores
                                           // before spawning). While a teacher's restarts are
                                           // below it, that dead teacher is awaited, not an error.
  std::atomic<uint32_t> refused; // nonzero: the teacher refused admission (a student's
                                 // config differs from its own); `refusal` says why.
                                 // Teacher writes refusal, then stores 1 (release)
  char refusal[kRefusalBytes]; // NUL-terminated; read after an acquire load of refused
  // A teacher that gave up (failed again on a request its earlier incarnation failed on): the
  // first one to do so claims the text (CAS 0 -> 1), writes it, then stores 2 (release); readers
  // read gaveUpText after an acquire load of 2.
  std::atomic<uint32_t> gaveUpState;
  char gaveUpText[kGaveUpTextBytes]; // NUL-terminated: which teacher, request, student and exception
  // One per teacher of the node (index 0..numTeachers-1; process index numStudents + t).
  struct alignas(kCacheLine) TeacherState {
    std::atomic<uint64_t> admitted; // its incarnation that admitted all its students, 0 = not yet
    std::atomic<int32_t> restarts; // restarts of this teacher so far (launcher, acq_rel increment)
    std::atomic<int32_t> replacedPid; // pid of its dead incarnation the launcher is replacing (stored
                                      // before restarts is incremented): awaited even once the last
                                      // restart is used up
    std::atomic<uint32_t> busyPermille; // share of the last second it spent in forward, in 1/1000
                                        // (teacher stores, relaxed)
    // teacher.cache, counted since its start (teacher stores, relaxed; readers may see a torn set):
    std::atomic<uint32_t> cacheFull; // 0; 1: teacher.cache.max_bytes reached; 2: a write failed
    std::atomic<uint64_t> cacheLookups; // rows looked up in the store
    std::atomic<uint64_t> cacheHits; // rows answered from the store
    std::atomic<uint64_t> cacheStoredTokens; // tokens of the rows it stored
    std::atomic<uint64_t> cacheStoredBytes; // what the store spends on them
    std::atomic<uint32_t> gaveUp; // nonzero: it failed twice on one request; not restarted (teacher
                                  // stores, release; launcher and its students load, acquire)
  };
  static_assert(sizeof(TeacherState) == kCacheLine, "TeacherState layout");
  TeacherState teachers[kMaxTeachers];
};
static_assert(sizeof(ControlBlock) <= kControlBytes, "ControlBlock too big");
static_assert(offsetof(ControlBlock, jobId) == 16 && offsetof(ControlBlock, numStudents) == 80, "ControlBlock layout");
uint32_t controlChecksum(const ControlBlock& c);

// One per local process. Identity fields are written by the owner at attach.
// `doorbell` is the futex word the owner sleeps on; anyone who changes a
// condition the owner may wait for bumps it (release) and FUTEX_WAKEs when
// `sleepers` != 0 (see port.h, "Waiting without lost wake-ups", for the ordering argument).
struct alignas(kCacheLine) ProcessEntry {
  std::atomic<int32_t> pid; // 0 = never attached
  std::atomic<uint32_t> state; // ProcState
  std::atomic<uint64_t> incarnation; // bumped at every attach of this local rank
  std::atomic<int64_t> heartbeatNs; // CLOCK_MONOTONIC ns, written every heartbeat_ms by the owner
  std::atomic<int32_t> rank; // global rank, for messages
  std::atomic<uint32_t> role; // 0 student, 1 teacher
  // Current wait, written by the owner (relaxed; diagnostics may see a torn set).
  std::atomic<uint32_t> waitWhat; // WaitWhat
  std::atomic<int32_t> waitPeer; // global rank waited on, -1 = any
  std::atomic<int64_t> waitStep;
  std::atomic<int64_t> waitAccStep;
  std::atomic<uint64_t> waitSeq;
  std::atomic<int64_t> waitSinceNs;
  std::atomic<uint32_t> doorbell; // futex word (shared, not PRIVATE)
  std::atomic<uint32_t> sleepers; // owner threads inside FUTEX_WAIT on doorbell
  std::atomic<int64_t> endedNs; // CLOCK_MONOTONIC ns when the owner detached (finished or dead), stored
                                // before the state (release); 0 while attached. The launcher orders
                                // failures by it: who failed first, not who exited first.
};
static_assert(sizeof(ProcessEntry) == 128, "ProcessEntry layout");

// ---- Status areas ----------------------------------------------------------------------------------
// Per process: the training status its owner publishes (core/status.h,
// StudentStatus), read by distill-run. A seqlock: the owner makes `seq` odd,
// stores the fields, makes it even (release); a reader that saw the same even
// seq before and after its (relaxed) loads read one whole record. 0 = never
// published. values[] holds StudentStatus's doubles in their order (NaN = not
// reported); `count` says how many the writer knew, the rest are spare.
enum StatusValue : uint32_t { kStatusLoss, kStatusKd, kStatusCe, kStatusTokensPerS, kStatusTeacherWait, kStatusTruncatedMass, kStatusMasked, kStatusSkipped, kStatusUsed };
constexpr int kStatusValues = 13;
struct alignas(kCacheLine) StatusArea {
  std::atomic<uint64_t> seq;
  std::atomic<int64_t> step;
  std::atomic<uint32_t> count; // values written (kStatusUsed of the writer)
  uint32_t reserved;
  std::atomic<double> values[kStatusValues];
};
static_assert(std::atomic<double>::is_always_lock_free, "shared-memory atomics must be lock free");
static_assert(sizeof(StatusArea) == 128 && kStatusUsed <= kStatusValues, "StatusArea layout");

// ---- Config areas ---------------------------------------------------------------------------------
// Per process: the description of its config (core's configDescription, opaque
// here), written by the owner at attach before it stores state = attached
// (release), so a reader that saw it attached (acquire) reads it whole.
struct ConfigArea {
  std::atomic<uint32_t> bytes; // length of text; 0 = nothing published
  uint32_t reserved;
  char text[kConfigBytesPerProcess - 8];
};
static_assert(sizeof(ConfigArea) == kConfigBytesPerProcess, "ConfigArea layout");
constexpr size_t kConfigTextBytes = sizeof(ConfigArea::text);

// ---- Flight recorder (ipc/src/recorder.h) ---------------------------------------------------------
// Per process: its recent events, written only by the owner, read by anyone
// (the launcher's watchdog and hang table). Each event is a seqlock: `number`
// is 0 while the owner rewrites it, then the event's 1-based number (release).
// Every field is a relaxed atomic so concurrent reads are race-free.

constexpr int kRecorderLabelWords = 7; // label: 56 bytes incl. NUL
struct alignas(kCacheLine) RecorderEvent {
  std::atomic<uint64_t> number; // 1-based event number; 0 = being written / empty
  std::atomic<uint32_t> op; // trace::Op
  std::atomic<int32_t> peer; // global rank of the peer, -1 = none / any
  std::atomic<int64_t> step; // -1 = unknown
  std::atomic<int64_t> accStep;
  std::atomic<uint64_t> seq; // message seq, or collective number
  std::atomic<int64_t> startNs; // CLOCK_MONOTONIC
  std::atomic<int64_t> endNs; // 0 = still open
  std::atomic<uint64_t> label[kRecorderLabelWords]; // NUL-terminated bytes
};
static_assert(sizeof(RecorderEvent) == 128, "RecorderEvent layout");

struct alignas(kCacheLine) RecorderHeader {
  std::atomic<uint64_t> begun; // events begun so far (release; the newest is number == begun)
  std::atomic<uint64_t> progress; // +1 at every begin and end (release): the watchdog's progress
  std::atomic<int64_t> lastEndNs; // when the newest event ended (or the recorder started): user code since
};
constexpr int kRecorderEvents = int((kRecorderBytesPerProcess - sizeof(RecorderHeader)) / sizeof(RecorderEvent));
struct RecorderArea : RecorderHeader {
  RecorderEvent events[kRecorderEvents];
};
static_assert(sizeof(RecorderArea) <= kRecorderBytesPerProcess, "RecorderArea too big");
static_assert(kRecorderEvents == 127, "RecorderArea layout");

// One SPSC ring. head: next sequence the producer publishes (producer writes,
// release; consumer reads, acquire). tail: next sequence the consumer frees
// (consumer writes, release; producer reads, acquire). Slot of sequence s is
// s % slots.
//
// CUDA exchange (ipc/src/cuda): the consumer cudaMallocs one buffer for all
// slots on its GPU, writes cudaSlotBytes/cudaDevice/cudaMem and then stores
// cudaMemReady = 1 (release); the producer creates one interprocess event per
// slot, writes their handles after the header and stores cudaEventsReady = 1
// (release). Each side opens the other's handles once, after an acquire load.
constexpr int kCudaIpcHandleBytes = 64; // sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
struct RingHeader {
  alignas(kCacheLine) std::atomic<uint64_t> head;
  alignas(kCacheLine) std::atomic<uint64_t> tail;
  alignas(kCacheLine) std::atomic<uint32_t> cudaMemReady;
  std::atomic<uint32_t> cudaEventsReady;
  int32_t cudaDevice; // consumer's device ordinal
  uint32_t reserved;
  uint64_t cudaSlotBytes; // per-slot CUDA buffer bytes
  char cudaMem[kCudaIpcHandleBytes]; // one cudaMalloc; slot i at i * cudaSlotBytes
  // Request rings: 1 + the sequence of the last request a teacher's forward raised on (0 = none).
  // The teacher exchanges it (acq_rel) for each request of a failed batch; finding that request's
  // own mark tells a restarted incarnation the failure repeats on the same input.
  std::atomic<uint64_t> failedSeq;
};
static_assert(sizeof(RingHeader) == 256, "RingHeader layout");
static_assert(offsetof(RingHeader, tail) == 64 && offsetof(RingHeader, cudaMem) == 152 &&
                  offsetof(RingHeader, failedSeq) == 216,
              "RingHeader layout");
// After each RingHeader: `slots` event handles (ringEventsBytes), then the slots.
constexpr size_t ringEventsBytes(int slots) { return alignUp(size_t(slots) * kCudaIpcHandleBytes, kCacheLine); }

// ---- The teacher's head object (shared_head.h; docs/design.md, "The teacher's head") ---------------
// A POSIX shared-memory object of its own beside the segment, "<segment>.head": this header at
// byte 0, then the weight [vocab, dim] and the bias [vocab] (if any), row-major, each at a
// multiple of kPayloadAlign. Written whole under a temporary name and renamed into place, so a
// visible object is complete; `complete` (stored 1 last, release) and the checksum catch one that
// is not (another writer, a corrupt file). Not part of the segment: no kLayoutVersion bump;
// kHeadLayoutVersion versions it.

constexpr uint64_t kHeadMagic = 0x3144414548544944ull; // "DITHEAD1", little endian
constexpr uint32_t kHeadLayoutVersion = 1;
constexpr size_t kHeadHeaderBytes = 4096; // the data start after one page
constexpr int kFingerprintBytes = 32; // SHA-256

struct HeadHeader {
  uint64_t magic; // kHeadMagic
  uint32_t layoutVersion; // kHeadLayoutVersion
  uint32_t checksum; // CRC32C of the bytes before `complete`, this field as 0
  uint64_t generation; // 1 for the first head published beside a segment, +1 at each republish
  uint64_t totalBytes; // the object's size; the reader checks the file holds as many
  uint32_t dtype; // DType: kFloat32, kFloat16 or kBFloat16
  uint32_t hasBias; // 0 or 1
  int64_t vocab; // V_t >= 1
  int64_t dim; // d_t >= 1
  double softcap; // >= 0, 0 = none
  double scale; // > 0, 1 = none
  uint64_t weightOffset, weightBytes; // vocab * dim * itemSize(dtype)
  uint64_t biasOffset, biasBytes; // vocab * itemSize(dtype), or 0 and 0
  int32_t publisherPid; // the teacher process that wrote it
  uint32_t reserved;
  uint8_t fingerprint[kFingerprintBytes]; // SHA-256 (headFingerprint)
  std::atomic<uint32_t> complete; // 1 once everything above and the data are written (release)
};
static_assert(offsetof(HeadHeader, fingerprint) == 112 && sizeof(HeadHeader) <= kHeadHeaderBytes,
              "HeadHeader layout");
uint32_t headHeaderChecksum(const HeadHeader& h);

// Validates a head object's header against the bytes the file holds (`fileBytes`, from fstat):
// magic, version, complete flag, checksum, dtype, dims, byte counts (overflow-checked), alignment,
// bounds, no overlap, softcap and scale. False with `why` naming the field and its values.
// Reads only the header: call it before touching any data byte (a short file would SIGBUS).
bool validateHeadHeader(const HeadHeader& h, uint64_t fileBytes, std::string* why);

} // namespace distill::ipc::wire
