// Endpoints: messages with named tensors over the rings of port.h.
#include <ATen/ATen.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <exception>
#include <mutex>

#include "distill/build_config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/ipc/channel.h"
#include "port.h"
#if DISTILL_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_ipc.h"
#endif

namespace distill::ipc {

const char* msgKindName(MsgKind k) { return wire::kindName(uint32_t(k)); }

EndpointOptions EndpointOptions::fromOptions(const TransportOptions& t, int rank) {
  EndpointOptions o;
  o.rank = rank;
  o.spinUs = t.spin_us;
  o.cudaIpc = t.cuda_ipc;
  o.cudaDevice = -1;  // set by the caller from student.device / teacher.device
  return o;
}

namespace {

int64_t toNs(Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); }

wire::DType toWire(at::ScalarType t, const std::string& name) {
  switch (t) {
    case at::kInt: return wire::DType::kInt32;
    case at::kLong: return wire::DType::kInt64;
    case at::kFloat: return wire::DType::kFloat32;
    case at::kHalf: return wire::DType::kFloat16;
    case at::kBFloat16: return wire::DType::kBFloat16;
    case at::kBool: return wire::DType::kBool;
    default:
      DISTILL_THROW(IpcError, "tensor '", name, "': dtype ", c10::toString(t),
                    " cannot be sent (int32, int64, float32, float16, bfloat16, bool)");
  }
}

at::ScalarType fromWire(uint32_t d) {
  switch (wire::DType(d)) {
    case wire::DType::kInt32: return at::kInt;
    case wire::DType::kInt64: return at::kLong;
    case wire::DType::kFloat32: return at::kFloat;
    case wire::DType::kFloat16: return at::kHalf;
    case wire::DType::kBFloat16: return at::kBFloat16;
    case wire::DType::kBool: return at::kBool;
  }
  return at::kByte;  // unreachable after validateHeader
}

}  // namespace

namespace detail {

// Shared by an endpoint and the messages it received (which may outlive it).
class ChannelCore : public std::enable_shared_from_this<ChannelCore> {
  using Desc = ReceivedMessage::Desc;
  static_assert(sizeof(Desc::name) == wire::kNameBytes && sizeof(Desc::shape) == wire::kMaxDims * sizeof(int64_t) &&
                    std::tuple_size<decltype(ReceivedMessage::tensors_)>::value == size_t(wire::kMaxTensors),
                "ReceivedMessage::Desc must hold what wire.h allows");

 public:
  ChannelCore(const Segment& seg, int index, const EndpointOptions& opt)
      : segment_(seg), opt_(opt), port_(seg.impl(), index, opt.rank, opt.spinUs, opt.config) {
    const auto& s = port_.seg();
    if (port_.isTeacher()) {
      for (int i = 0; i < s.layout.numStudents; ++i) {
        in_.emplace_back(s, i, false);
        out_.emplace_back(s, i, true);
        // Elastic teacher: the teacher answers each student's requests in
        // ring order, one response each, and frees a request slot only after
        // answering it. So the response ring's head is the number of that
        // student's requests already answered, by this or an earlier
        // incarnation; the requests still in the ring below it were answered
        // by a teacher that died before freeing them and are skipped (freed
        // unanswered), the rest are served: none lost, none answered twice.
        answered_.push_back(out_.back().writeSeq());
        const uint64_t unfreed = answered_.back() > in_.back().readSeq() ? answered_.back() - in_.back().readSeq() : 0;
        if (unfreed > 0) {
          DISTILL_LOG(kWarning) << port_.describeSelf() << ": student local " << i << ": " << unfreed
                                << " request(s) answered by the previous teacher incarnation are still in the ring;"
                                << " freeing them unanswered";
        }
      }
    } else {
      in_.emplace_back(s, index, true);
      out_.emplace_back(s, index, false);
    }
    setUpCuda();
  }

  Port& port() { return port_; }
  const Segment& segment() const { return segment_; }
  int numRings() const { return int(in_.size()); }
  // Process index on the other side of ring r.
  int peerOf(int r) const { return port_.isTeacher() ? r : port_.seg().teacherIndex(); }
  int studentOf(int r) const { return port_.isTeacher() ? r : port_.index(); }
  const char* outName() const { return port_.isTeacher() ? "response" : "request"; }
  const char* capacityKey() const {
    return port_.isTeacher() ? "transport.max_response_bytes" : "transport.max_request_bytes";
  }

  void rethrowIfPoisoned() {
    if (poison_) std::rethrow_exception(poison_);
  }
  template <typename F>
  auto guarded(F f) -> decltype(f()) {
    rethrowIfPoisoned();
    try {
      return f();
    } catch (const PeerLostError&) {
      poison_ = std::current_exception();
      throw;
    } catch (const ProtocolError&) {
      poison_ = std::current_exception();
      throw;
    }
  }

  // ---- CUDA IPC (see cuda/cuda_ipc.h) -----------------------------------------------------------

#if DISTILL_CUDA
  static void* streamOf(int device) {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  }
  void setUpCuda() {
    if (opt_.cudaIpc == CudaIpc::kOff) return;
    const bool usable = opt_.cudaDevice >= 0 && opt_.cudaDevice < cuda::deviceCount();
    DISTILL_CHECK_T(IpcError, usable || opt_.cudaIpc != CudaIpc::kOn, port_.describeSelf(),
                    ": transport.cuda_ipc=on but device ", opt_.cudaDevice, " is not usable (",
                    cuda::deviceCount(), " CUDA devices visible)");
    if (!usable) return;
    for (const auto& r : in_)
      consumers_.push_back(std::make_unique<cuda::ConsumerBuffers>(port_.seg(), r.student(), r.response(), opt_.cudaDevice));
    for (const auto& r : out_)
      producers_.push_back(std::make_unique<cuda::ProducerBuffers>(port_.seg(), r.student(), r.response(), opt_.cudaDevice));
  }
  // True if CUDA tensors to out ring r can go through the consumer's buffer.
  bool cudaOut(int r) { return !producers_.empty() && producers_[size_t(r)]->ready(); }
#else
  void setUpCuda() {
    DISTILL_CHECK_T(IpcError, opt_.cudaIpc != CudaIpc::kOn, port_.describeSelf(),
                    ": transport.cuda_ipc=on but distill was built without CUDA (DISTILL_CUDA=0)");
  }
  bool cudaOut(int) { return false; }
#endif

  // ---- producing ---------------------------------------------------------------------------------

  // What plan() needs of one tensor; points into the caller's objects (no copies
  // of names or shapes on the per-message path).
  struct PlanItem {
    const std::string* name = nullptr;
    at::ScalarType dtype = at::kFloat;
    c10::IntArrayRef shape;
    bool cuda = false;
  };
  struct Planned {
    wire::SlotHeader hdr{};
  };

  // Lays out tensors at 64-byte aligned offsets; IpcError if they do not fit.
  Planned plan(int r, const Tag& tag, MsgKind kind, const PlanItem* items, size_t count, const std::string& errorText) {
    Planned p;
    auto& h = p.hdr;
    h.seq = tag.seq;
    h.step = tag.step;
    h.accStep = tag.accStep;
    h.kind = uint32_t(kind);
    h.senderRank = port_.rank();
    h.ntensors = uint32_t(count);
    if (!errorText.empty()) std::strncpy(h.errorText, errorText.c_str(), sizeof h.errorText - 1);
    const int64_t cap = out_[r].capacity();
    uint64_t usedBy[2] = {0, 0};  // host payload, CUDA buffer
    for (size_t i = 0; i < count; ++i) {
      const auto& s = items[i];
      const std::string& name = *s.name;
      auto& t = h.tensors[i];
      DISTILL_CHECK_T(IpcError, !name.empty() && name.size() < size_t(wire::kNameBytes), "tensor name '", name,
                      "' must have 1..", wire::kNameBytes - 1, " characters");
      for (size_t j = 0; j < i; ++j)
        DISTILL_CHECK_T(IpcError, *items[j].name != name, "two tensors named '", name, "' in one message");
      DISTILL_CHECK_T(IpcError, s.shape.size() <= size_t(wire::kMaxDims), "tensor '", name, "' has ",
                      s.shape.size(), " dims; at most ", wire::kMaxDims, " can be sent");
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
      const bool cuda = s.cuda;
      t.location = uint32_t(cuda ? wire::Location::kCuda : wire::Location::kHost);
      uint64_t& used = usedBy[cuda ? 1 : 0];
      t.offset = wire::alignUp(used, wire::kPayloadAlign);
      used = t.offset + t.nbytes;
      if (used > uint64_t(cap))
        DISTILL_THROW(IpcError, at(tag.step, tag.accStep), port_.describeSelf(), ": tensor '", name, "' of ",
                      t.nbytes, " bytes does not fit a ", outName(), " slot: the message needs ", used,
                      " bytes, the slot holds ", cap, " bytes; raise ", capacityKey(), " to at least ",
                      wire::alignUp(used, wire::kPayloadAlign), " (segment '", port_.seg().name, "')");
    }
    return p;
  }

  // Waits for a free slot in out ring r; returns its ring sequence.
  uint64_t acquire(int r, const Tag& tag, Deadline deadline) {
    auto& ring = out_[r];
    if (ring.canWrite()) return ring.writeSeq();  // the common case: no clock, no wait bookkeeping
    WaitDesc d{port_.isTeacher() ? wire::WaitWhat::kResponseSlot : wire::WaitWhat::kRequestSlot, peerOf(r), true,
               tag.step, tag.accStep, tag.seq};
    const auto start = Clock::now();
    if (!port_.waitUntil([&] { return ring.canWrite(); }, d, {peerOf(r)}, true, deadline))
      DISTILL_THROW(TimeoutError, at(tag.step, tag.accStep, wire::waitName(uint32_t(d.what))), port_.describeSelf(),
                    ": no free ", outName(), " slot after ", toMs(Clock::now() - start), " ms (all ", ring.slots(),
                    " slots held by ", port_.describeProcess(peerOf(r)), ", seq ", tag.seq, ", segment '",
                    port_.seg().name, "')");
    return ring.writeSeq();
  }

  void commit(int r, wire::SlotHeader& hdr) {
    auto& ring = out_[r];
    wire::sealHeader(hdr);
    std::memcpy(ring.slot(ring.writeSeq()), &hdr, wire::headerBytes(hdr));
    ring.publish(peerOf(r));
    port_.recorder().complete(port_.isTeacher() ? trace::Op::kReply : trace::Op::kSend,
                              port_.seg().process(peerOf(r)).rank.load(std::memory_order_relaxed), hdr.step,
                              hdr.accStep, hdr.seq, 0, kindLabel(hdr.kind));
  }

  // Flight-recorder label of a message kind: only the unusual ones get one.
  static const char* kindLabel(uint32_t kind) {
    return kind == uint32_t(wire::Kind::kFinish) ? "finish" : kind == uint32_t(wire::Kind::kError) ? "error" : "";
  }

  void send(int r, const OutMessage& msg, Deadline deadline) {
    guarded([&] {
      DISTILL_CHECK_T(IpcError, pending_ < 0, port_.describeSelf(), ": send() while an allocate() is not published");
      const size_t n = msg.tensors.size();
      DISTILL_CHECK_T(IpcError, n <= size_t(wire::kMaxTensors), port_.describeSelf(), ": a message holds at most ",
                      wire::kMaxTensors, " tensors, got ", n);
      // Fixed arrays, not vectors: this is the per-message path.
      std::array<at::Tensor, wire::kMaxTensors> src;
      std::array<PlanItem, wire::kMaxTensors> items;
      std::array<bool, wire::kMaxTensors> onCuda{};
      bool anyCuda = false;
      for (size_t i = 0; i < n; ++i) {
        const auto& [name, t] = msg.tensors[i];
        DISTILL_CHECK_T(IpcError, t.defined(), "tensor '", name, "' is undefined");
        // CUDA tensors go through the consumer's CUDA buffer when it has one,
        // else they are staged through the host slot.
        const bool cuda = t.is_cuda() && cudaOut(r);
        const at::Tensor& staged = (t.is_cuda() && !cuda) ? (src[i] = t.cpu()) : t;
        src[i] = staged.is_contiguous() ? staged : staged.contiguous();
        items[i] = PlanItem{&name, src[i].scalar_type(), src[i].sizes(), cuda};
        onCuda[i] = cuda;
        anyCuda = anyCuda || cuda;
      }
      Planned p = plan(r, msg.tag, msg.kind, items.data(), n, msg.errorText);
      const uint64_t seq = acquire(r, msg.tag, deadline);
      uint8_t* payload = out_[r].payload(seq);
      for (size_t i = 0; i < n; ++i) {
        const auto& d = p.hdr.tensors[i];
        if (d.nbytes == 0) continue;
#if DISTILL_CUDA
        if (onCuda[i]) {
          producers_[size_t(r)]->copyIn(seq % uint64_t(out_[r].slots()), d.offset, src[i].data_ptr(), d.nbytes,
                                        streamOf(src[i].device().index()));
          continue;
        }
#endif
        std::memcpy(payload + d.offset, src[i].data_ptr(), d.nbytes);
      }
#if DISTILL_CUDA
      // The consumer waits on this event before reading (recorded before the header is published).
      if (anyCuda) producers_[size_t(r)]->recordWritten(seq % uint64_t(out_[r].slots()), streamOf(opt_.cudaDevice));
#else
      (void)anyCuda;
#endif
      commit(r, p.hdr);
    });
  }

  std::vector<at::Tensor> allocate(int r, const Tag& tag, MsgKind kind, const std::vector<TensorSpec>& specs,
                                   Deadline deadline) {
    return guarded([&] {
      DISTILL_CHECK_T(IpcError, pending_ < 0, port_.describeSelf(), ": allocate() while another is not published");
      DISTILL_CHECK_T(IpcError, specs.size() <= size_t(wire::kMaxTensors), port_.describeSelf(),
                      ": a message holds at most ", wire::kMaxTensors, " tensors, got ", specs.size());
      std::array<PlanItem, wire::kMaxTensors> items;
      for (size_t i = 0; i < specs.size(); ++i) items[i] = PlanItem{&specs[i].name, specs[i].dtype, specs[i].shape};
      Planned p = plan(r, tag, kind, items.data(), specs.size(), {});
      const uint64_t seq = acquire(r, tag, deadline);
      uint8_t* payload = out_[r].payload(seq);
      std::vector<at::Tensor> out;
      for (size_t i = 0; i < specs.size(); ++i)
        out.push_back(at::from_blob(payload + p.hdr.tensors[i].offset, specs[i].shape,
                                    at::TensorOptions().dtype(specs[i].dtype)));
      pendingHdr_ = p.hdr;
      pending_ = r;
      return out;
    });
  }

  void publish(int r) {
    DISTILL_CHECK_T(IpcError, pending_ == r, port_.describeSelf(), ": publish() without a matching allocate()");
    pending_ = -1;
    guarded([&] { commit(r, pendingHdr_); });
  }

  // ---- consuming ---------------------------------------------------------------------------------

  // Takes the message at the read cursor of in ring r (which must be readable);
  // the flight recorder notes it as begun at `startNs` (when the wait for it
  // began; 0 = it was already there).
  ReceivedMessage take(int r, int64_t startNs = 0) {
    auto& ring = in_[r];
    uint64_t seq;
    wire::SlotHeader h;
    {
      std::lock_guard<std::mutex> lock(inMutex_);
      seq = ring.readSeq();
      // Validate a private copy: the producer cannot change what we checked.
      // Only the used prefix is copied (wire::headerBytes), sized from the
      // copied fixed fields; the rest of the private copy is zero.
      const auto* shared = reinterpret_cast<const unsigned char*>(ring.slot(seq));
      constexpr size_t fixed = offsetof(wire::SlotHeader, tensors);
      std::memcpy(&h, shared, fixed);
      const size_t used = wire::headerBytes(h);
      std::memcpy(reinterpret_cast<unsigned char*>(&h) + fixed, shared + fixed, used - fixed);
      std::memset(reinterpret_cast<unsigned char*>(&h) + used, 0, sizeof h - used);
      ring.consumed();
    }
    std::string why;
    if (!wire::validateHeader(h, size_t(ring.capacity()), &why)) {
      releaseSlot(r, seq);
      DISTILL_THROW(ProtocolError, port_.describeSelf(), ": invalid ", ring.response() ? "response" : "request",
                    " header from ", port_.describeProcess(peerOf(r)), ": ", why, " (segment '", port_.seg().name,
                    "', ring seq ", seq, ")");
    }
    ReceivedMessage m;
    m.core_ = shared_from_this();
    m.ring_ = r;
    m.seq_ = seq;
    m.tag_ = Tag{h.seq, h.step, h.accStep};
    m.kind_ = MsgKind(h.kind);
    m.senderRank_ = h.senderRank;
    m.student_ = studentOf(r);
    if (h.kind == uint32_t(wire::Kind::kError)) m.errorText_ = h.errorText;
    uint8_t* payload = ring.payload(seq);
    const uint64_t slot = seq % uint64_t(ring.slots());
    bool waited = false;
    for (uint32_t i = 0; i < h.ntensors; ++i) {
      const auto& t = h.tensors[i];
      void* data = payload + t.offset;
      int device = -1;
      if (t.location == uint32_t(wire::Location::kCuda)) {
#if DISTILL_CUDA
        if (!consumers_.empty()) {
          auto& cb = *consumers_[size_t(r)];
          device = cb.device();
          data = static_cast<char*>(cb.slotPtr(slot)) + t.offset;
          if (!waited) waited = cb.waitWritten(slot, streamOf(device));
        }
#endif
        if (!waited) {
          m.core_.reset();
          releaseSlot(r, seq);
          DISTILL_THROW(ProtocolError, port_.describeSelf(), ": tensor '", t.name, "' from ",
                        port_.describeProcess(peerOf(r)),
                        " is in a CUDA buffer but no CUDA IPC buffer/event is set up on this ring");
        }
      }
      auto& desc = m.tensors_[i];
      std::memcpy(desc.name, t.name, sizeof desc.name);
      desc.dtype = fromWire(t.dtype);
      desc.ndim = int(t.ndim);
      std::memcpy(desc.shape, t.shape, sizeof desc.shape);
      desc.data = data;
      desc.device = device;
    }
    m.ntensors_ = int(h.ntensors);
    port_.recorder().complete(port_.isTeacher() ? trace::Op::kRequest : trace::Op::kReceive, h.senderRank, h.step,
                              h.accStep, h.seq, startNs, kindLabel(h.kind));
    return m;
  }

  // `cudaDevice` >= 0: the message had tensors in the CUDA buffer; wait until
  // the reads queued on that device's current stream are done first.
  void releaseSlot(int r, uint64_t seq, int cudaDevice = -1) {
#if DISTILL_CUDA
    if (cudaDevice >= 0 && !consumers_.empty()) consumers_[size_t(r)]->readsDone(streamOf(cudaDevice));
#else
    (void)cudaDevice;
#endif
    std::lock_guard<std::mutex> lock(inMutex_);
    in_[r].release(seq, peerOf(r));
  }

  bool canRead(int r) {
    std::lock_guard<std::mutex> lock(inMutex_);
    auto& ring = in_[r];
    if (!answered_.empty()) {  // teacher: skip what an earlier incarnation answered (see the constructor)
      while (ring.canRead() && ring.readSeq() < answered_[size_t(r)]) {
        const uint64_t seq = ring.readSeq();
        ring.consumed();
        ring.release(seq, peerOf(r));
      }
    }
    return ring.canRead();
  }

  // Teacher: student ring r detached cleanly and left nothing to read.
  bool studentDone(int r) {
    const auto st = wire::ProcState(port_.seg().process(r).state.load(std::memory_order_acquire));
    return st == wire::ProcState::kFinished && !canRead(r);
  }

  std::optional<ReceivedMessage> tryReceive(int r) {
    return guarded([&]() -> std::optional<ReceivedMessage> {
      if (!canRead(r)) return std::nullopt;
      return take(r);
    });
  }

  ReceivedMessage receive(int r, Deadline deadline, const std::optional<Tag>& expect) {
    return guarded([&] {
      if (canRead(r)) return take(r);  // already there: no clock, no wait bookkeeping
      WaitDesc d{wire::WaitWhat::kResponse, peerOf(r), expect.has_value(), expect ? expect->step : 0,
                 expect ? expect->accStep : 0, expect ? expect->seq : 0};
      const auto start = Clock::now();
      const int64_t startNs = monotonicNs();
      if (!port_.waitUntil([&] { return canRead(r); }, d, {peerOf(r)}, true, deadline)) {
        ErrorWhere w = expect ? at(expect->step, expect->accStep) : ErrorWhere{};
        w.awaited = distill::detail::str("response from ", port_.describeProcess(peerOf(r)));
        DISTILL_THROW(TimeoutError, w, port_.describeSelf(), ": no response from ",
                      port_.describeProcess(peerOf(r)), " after ", toMs(Clock::now() - start), " ms",
                      expect ? distill::detail::str(" (awaiting seq ", expect->seq, ")") : std::string(), ", segment '",
                      port_.seg().name, "'");
      }
      return take(r, startNs);
    });
  }

  ReceivedMessage waitAny(Deadline deadline) {
    return guarded([&] {
      const int n = numRings();
      int found = -1;
      auto any = [&] {
        for (int k = 1; k <= n; ++k) {
          const int r = (lastAny_ + k) % n;
          if (canRead(r)) {
            found = r;
            return true;
          }
        }
        return false;
      };
      if (any()) {  // already there: no clock, no wait bookkeeping
        lastAny_ = found;
        return take(found);
      }
      std::vector<int> peers;
      for (int i = 0; i < n; ++i) peers.push_back(i);
      const auto start = Clock::now();
      const int64_t startNs = monotonicNs();
      if (!port_.waitUntil(any, WaitDesc{wire::WaitWhat::kRequest}, peers, false, deadline))
        DISTILL_THROW(TimeoutError, awaiting("request from any student"), port_.describeSelf(),
                      ": no request from any of ", n, " students after ", toMs(Clock::now() - start),
                      " ms (segment '", port_.seg().name, "')");
      lastAny_ = found;
      return take(found, startNs);
    });
  }

  // ---- admission ---------------------------------------------------------------------------------

  void teacherAdmission(Deadline deadline, const AdmissionCheck& check) {
    guarded([&] {
      auto& s = port_.seg();
      auto attached = [&](int i) {
        const auto& e = s.process(i);
        const auto st = wire::ProcState(e.state.load(std::memory_order_acquire));
        return e.pid.load(std::memory_order_acquire) != 0 && st != wire::ProcState::kEmpty &&
               st != wire::ProcState::kFinished && st != wire::ProcState::kDead;
      };
      // A restarted teacher also admits students that finished while no
      // teacher ran (the server then sees them done, studentDone()).
      const bool restarted = s.control().teacherRestarts.load(std::memory_order_acquire) > 0;
      auto present = [&](int i) {
        return attached(i) || (restarted && wire::ProcState(s.process(i).state.load(std::memory_order_acquire)) ==
                                                wire::ProcState::kFinished);
      };
      std::vector<int> peers;
      for (int i = 0; i < s.layout.numStudents; ++i) peers.push_back(i);
      // Each student is checked once, as soon as it is there (its config was
      // published before its attached state, which present() loaded with
      // acquire); a refusal ends the wait at once.
      std::vector<bool> checked(peers.size(), !check);
      std::string refusal;
      auto all = [&] {
        bool every = true;
        for (int i : peers) {
          if (!present(i)) {
            every = false;
            continue;
          }
          if (checked[size_t(i)]) continue;
          checked[size_t(i)] = true;
          refusal = check(i, port_.publishedConfig(i));
          if (!refusal.empty()) return true;
        }
        return every;
      };
      const auto start = Clock::now();
      if (!port_.waitUntil(all, WaitDesc{wire::WaitWhat::kAdmission}, peers, !restarted, deadline)) {
        std::string missing;
        for (int i : peers)
          if (!present(i)) missing += distill::detail::str(missing.empty() ? "" : ", ", "local ", i);
        DISTILL_THROW(TimeoutError, awaiting("all local students to attach"), port_.describeSelf(),
                      ": students [", missing, "] did not attach to segment '", s.name, "' within ",
                      toMs(Clock::now() - start), " ms");
      }
      if (!refusal.empty()) {
        // The text before the flag (release): a student that sees the flag reads it whole.
        auto& c = s.control();
        const size_t n = std::min(refusal.size(), size_t(wire::kRefusalBytes) - 1);
        std::memcpy(c.refusal, refusal.data(), n);
        c.refusal[n] = '\0';
        c.refused.store(1, std::memory_order_release);
        s.notifyAll();
        DISTILL_THROW(ConfigError, awaiting("all local students to attach"), refusal);
      }
      s.control().admitted.store(port_.self().incarnation.load(std::memory_order_relaxed),
                                 std::memory_order_release);
      port_.recorder().complete(trace::Op::kAdmission, -1, -1, -1, 0, monotonicNs() - toNs(Clock::now() - start));
      port_.setState(wire::ProcState::kServing);
      s.notifyAll();
    });
  }

  void studentAdmission(Deadline deadline) {
    guarded([&] {
      auto& s = port_.seg();
      const int t = s.teacherIndex();
      auto refused = [&] { return s.control().refused.load(std::memory_order_acquire) != 0; };
      auto admitted = [&] {
        const uint64_t a = s.control().admitted.load(std::memory_order_acquire);
        return refused() || (a != 0 && a == s.process(t).incarnation.load(std::memory_order_relaxed));
      };
      const auto start = Clock::now();
      const auto& e = s.process(t);
      // The refusal is checked before the wait too: a teacher that refused may
      // be gone (dead) by the time this student attached.
      if (!refused() &&
          !port_.waitUntil(admitted, WaitDesc{wire::WaitWhat::kAdmission, t}, {t}, true, deadline)) {
        DISTILL_THROW(TimeoutError, awaiting("admission by the teacher"), port_.describeSelf(),
                      ": not admitted by the teacher (local ", t, ", state ",
                      wire::stateName(e.state.load(std::memory_order_relaxed)),
                      e.pid.load(std::memory_order_relaxed) ? "" : ", never attached", ") of segment '", s.name,
                      "' within ", toMs(Clock::now() - start), " ms");
      }
      if (refused()) {
        const auto& c = s.control();
        DISTILL_THROW(ConfigError, awaiting("admission by the teacher"), "admission refused by the teacher (",
                      port_.describeProcess(t), ") of segment '", s.name, "': ",
                      std::string(c.refusal, strnlen(c.refusal, sizeof c.refusal)));
      }
      port_.recorder().complete(trace::Op::kAdmission, e.rank.load(std::memory_order_relaxed), -1, -1, 0, monotonicNs() - toNs(Clock::now() - start));
    });
  }

 private:
  Segment segment_;
  EndpointOptions opt_;
  Port port_;
  std::vector<RingSide> in_, out_;
  std::mutex inMutex_;  // consumer cursors: messages may be released from other threads
  std::exception_ptr poison_;
  std::vector<uint64_t> answered_;  // teacher: per student, requests answered when this incarnation attached
  int pending_ = -1;  // out ring with an unpublished allocate()
  wire::SlotHeader pendingHdr_{};
  int lastAny_ = -1;
#if DISTILL_CUDA
  std::vector<std::unique_ptr<cuda::ConsumerBuffers>> consumers_;  // per in ring
  std::vector<std::unique_ptr<cuda::ProducerBuffers>> producers_;  // per out ring
#endif
};

}  // namespace detail

// ---- ReceivedMessage ------------------------------------------------------------------------------

ReceivedMessage::ReceivedMessage() = default;
ReceivedMessage::~ReceivedMessage() { release(); }
ReceivedMessage::ReceivedMessage(ReceivedMessage&& o) noexcept { *this = std::move(o); }
ReceivedMessage& ReceivedMessage::operator=(ReceivedMessage&& o) noexcept {
  if (this != &o) {
    release();
    core_ = std::move(o.core_);
    ring_ = o.ring_;
    seq_ = o.seq_;
    tag_ = o.tag_;
    kind_ = o.kind_;
    senderRank_ = o.senderRank_;
    student_ = o.student_;
    errorText_ = std::move(o.errorText_);
    tensors_ = o.tensors_;
    ntensors_ = o.ntensors_;
    o.ntensors_ = 0;
  }
  return *this;
}

void ReceivedMessage::release() {
  if (core_) {
    int device = -1;
    for (int i = 0; i < ntensors_; ++i) device = std::max(device, tensors_[size_t(i)].device);
    core_->releaseSlot(ring_, seq_, device);
    core_.reset();
  }
}

std::vector<std::string> ReceivedMessage::names() const {
  std::vector<std::string> out;
  for (int i = 0; i < ntensors_; ++i) out.emplace_back(tensors_[size_t(i)].name);
  return out;
}

bool ReceivedMessage::has(const std::string& name) const {
  for (int i = 0; i < ntensors_; ++i)
    if (name == tensors_[size_t(i)].name) return true;
  return false;
}

const ReceivedMessage::Desc& ReceivedMessage::find(const std::string& name) const {
  for (int i = 0; i < ntensors_; ++i)
    if (name == tensors_[size_t(i)].name) return tensors_[size_t(i)];
  std::string all;
  for (int i = 0; i < ntensors_; ++i) all += (all.empty() ? "" : ", ") + std::string(tensors_[size_t(i)].name);
  DISTILL_THROW(ProtocolError, at(tag_.step, tag_.accStep), "message seq ", tag_.seq, " from rank ", senderRank_,
                " has no tensor '", name, "' (has: ", all, ")");
}

at::Tensor ReceivedMessage::view(const std::string& name) const {
  DISTILL_CHECK_T(IpcError, held(), "view('", name, "') on a released message (use copy() to keep data)");
  const auto& d = find(name);
  auto opts = at::TensorOptions().dtype(d.dtype);
  if (d.device >= 0) opts = opts.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d.device)));
  return at::from_blob(d.data, c10::IntArrayRef(d.shape, size_t(d.ndim)), opts);
}

at::Tensor ReceivedMessage::copy(const std::string& name) const { return view(name).clone(); }

// ---- StudentEndpoint ------------------------------------------------------------------------------

StudentEndpoint::StudentEndpoint(const Segment& segment, int localIndex, EndpointOptions options)
    : uncaught_(std::uncaught_exceptions()) {
  DISTILL_CHECK_T(IpcError, localIndex >= 0 && localIndex < segment.layout().numStudents, "local student index ",
                  localIndex, " outside 0..", segment.layout().numStudents - 1, " (segment '", segment.name(), "')");
  core_ = std::make_shared<detail::ChannelCore>(segment, localIndex, options);
}
StudentEndpoint::StudentEndpoint(StudentEndpoint&&) noexcept = default;
StudentEndpoint::~StudentEndpoint() {
  if (core_ && std::uncaught_exceptions() == uncaught_) core_->port().markFinished();
}
void StudentEndpoint::waitAdmission(Deadline d) { core_->studentAdmission(d); }
void StudentEndpoint::send(const OutMessage& msg, Deadline d) { core_->send(0, msg, d); }
std::vector<at::Tensor> StudentEndpoint::allocate(const Tag& tag, const std::vector<TensorSpec>& specs, Deadline d,
                                                  MsgKind kind) {
  return core_->allocate(0, tag, kind, specs, d);
}
void StudentEndpoint::publish() { core_->publish(0); }
ReceivedMessage StudentEndpoint::receive(Deadline d, const std::optional<Tag>& expect) {
  return core_->receive(0, d, expect);
}
std::optional<ReceivedMessage> StudentEndpoint::tryReceive() { return core_->tryReceive(0); }
int StudentEndpoint::localIndex() const { return core_->port().index(); }
int StudentEndpoint::rank() const { return core_->port().rank(); }
Segment StudentEndpoint::segment() const { return core_->segment(); }

// ---- TeacherEndpoint ------------------------------------------------------------------------------

TeacherEndpoint::TeacherEndpoint(const Segment& segment, EndpointOptions options)
    : core_(std::make_shared<detail::ChannelCore>(segment, segment.layout().numStudents, options)),
      uncaught_(std::uncaught_exceptions()) {}
TeacherEndpoint::TeacherEndpoint(TeacherEndpoint&&) noexcept = default;
TeacherEndpoint::~TeacherEndpoint() {
  if (core_ && std::uncaught_exceptions() == uncaught_) core_->port().markFinished();
}
void TeacherEndpoint::waitAdmission(Deadline d, const AdmissionCheck& check) { core_->teacherAdmission(d, check); }
bool TeacherEndpoint::studentDone(int student) {
  DISTILL_CHECK_T(IpcError, student >= 0 && student < numStudents(), "studentDone(", student, "): no such local student");
  return core_->studentDone(student);
}
int TeacherEndpoint::numStudents() const { return core_->numRings(); }
std::optional<ReceivedMessage> TeacherEndpoint::poll(int student) {
  DISTILL_CHECK_T(IpcError, student >= 0 && student < numStudents(), "poll(", student, "): no such local student");
  return core_->tryReceive(student);
}
ReceivedMessage TeacherEndpoint::waitAny(Deadline d) { return core_->waitAny(d); }
void TeacherEndpoint::reply(int student, const OutMessage& msg, Deadline d) {
  DISTILL_CHECK_T(IpcError, student >= 0 && student < numStudents(), "reply(", student, "): no such local student");
  core_->send(student, msg, d);
}
std::vector<at::Tensor> TeacherEndpoint::allocateReply(int student, const Tag& tag, const std::vector<TensorSpec>& specs,
                                                       Deadline d, MsgKind kind) {
  DISTILL_CHECK_T(IpcError, student >= 0 && student < numStudents(), "allocateReply(", student,
                  "): no such local student");
  return core_->allocate(student, tag, kind, specs, d);
}
void TeacherEndpoint::publishReply(int student) { core_->publish(student); }
int TeacherEndpoint::rank() const { return core_->port().rank(); }
Segment TeacherEndpoint::segment() const { return core_->segment(); }

}  // namespace distill::ipc
