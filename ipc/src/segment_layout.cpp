// A segment's layout (segment_impl.h): the layout a config asks for, its
// checks, the offsets it gives, and the control block that records them. Pure
// arithmetic over wire.h; the shared-memory mapping itself is segment.cpp's.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "distill/core/errors.h"
#include "distill/core/payload.h"
#include "segment_impl.h"

namespace distill::ipc {

static_assert(wire::kMaxTeachers == kMaxTeachersPerNode, "teacher.procs' bound is the segment's");

SegmentLayout SegmentLayout::fromConfig(const Config& c, int numStudents, int numTeachers) {
  checkSlotBytes(c);
  const TransportOptions& t = c.transport;
  SegmentLayout l;
  l.numStudents = numStudents;
  l.numTeachers = numTeachers;
  l.slots = t.slots;
  l.maxRequestBytes = requestSlotBytes(c);
  l.maxResponseBytes = responseSlotBytes(c);
  l.heartbeatMs = t.heartbeat_ms;
  l.stallTimeoutMs = std::max<int64_t>(1, std::llround(t.stall_timeout_s * 1000));
  return l;
}

SegmentLayout SegmentLayout::expectedFromConfig(const Config& c, int numStudents, int numTeachers) {
  SegmentLayout l = fromConfig(c, numStudents, numTeachers);
  if (c.transport.max_request_bytes == 0) l.maxRequestBytes = 0;
  if (c.transport.max_response_bytes == 0) l.maxResponseBytes = 0;
  return l;
}

bool SegmentLayout::matches(const SegmentLayout& expected) const {
  SegmentLayout e = expected;
  if (e.maxRequestBytes == 0) e.maxRequestBytes = maxRequestBytes;
  if (e.maxResponseBytes == 0) e.maxResponseBytes = maxResponseBytes;
  return e == *this;
}

bool SegmentLayout::operator==(const SegmentLayout& o) const {
  return numStudents == o.numStudents && slots == o.slots && maxRequestBytes == o.maxRequestBytes &&
      maxResponseBytes == o.maxResponseBytes && heartbeatMs == o.heartbeatMs && numTeachers == o.numTeachers &&
      stallTimeoutMs == o.stallTimeoutMs;
}

std::string SegmentLayout::describe() const {
  return detail::str("students=", numStudents, " teachers=", numTeachers, " slots=", slots,
                     " request_bytes=", maxRequestBytes, " response_bytes=", maxResponseBytes,
                     " heartbeat_ms=", heartbeatMs, " stall_timeout_ms=", stallTimeoutMs);
}

LayoutOffsets computeOffsets(const SegmentLayout& l) {
  using wire::alignUp;
  LayoutOffsets o{};
  const uint64_t procs = uint64_t(l.numStudents) + uint64_t(l.numTeachers);
  o.processTable = wire::kControlBytes;
  o.status = alignUp(o.processTable + procs * sizeof(wire::ProcessEntry), wire::kCacheLine);
  o.recorder = alignUp(o.status + procs * sizeof(wire::StatusArea), 4096);
  o.config = alignUp(o.recorder + procs * wire::kRecorderBytesPerProcess, 4096);
  o.rings = alignUp(o.config + procs * wire::kConfigBytesPerProcess, 4096);
  o.requestSlotStride = wire::kSlotHeaderBytes + alignUp(uint64_t(l.maxRequestBytes), wire::kPayloadAlign);
  o.responseSlotStride = wire::kSlotHeaderBytes + alignUp(uint64_t(l.maxResponseBytes), wire::kPayloadAlign);
  const uint64_t ringFixed = sizeof(wire::RingHeader) + wire::ringEventsBytes(l.slots);
  o.requestRingBytes = ringFixed + uint64_t(l.slots) * o.requestSlotStride;
  o.responseRingBytes = ringFixed + uint64_t(l.slots) * o.responseSlotStride;
  o.ringPairStride = o.requestRingBytes + o.responseRingBytes;
  o.total = o.rings + uint64_t(l.numStudents) * o.ringPairStride;
  return o;
}

void checkLayout(const SegmentLayout& l, const std::string& name) {
  DISTILL_CHECK_T(IpcError, l.numStudents >= 1 && l.numStudents <= wire::kMaxStudents, "segment '", name,
                  "': numStudents ", l.numStudents, " outside 1..", wire::kMaxStudents);
  DISTILL_CHECK_T(IpcError, l.numTeachers >= 1 && l.numTeachers <= wire::kMaxTeachers, "segment '", name,
                  "': numTeachers ", l.numTeachers, " outside 1..", wire::kMaxTeachers, " (teacher.procs)");
  DISTILL_CHECK_T(IpcError, l.slots >= 1 && l.slots <= wire::kMaxSlots, "segment '", name, "': slots ", l.slots,
                  " outside 1..", wire::kMaxSlots, " (transport.slots)");
  DISTILL_CHECK_T(IpcError, l.maxRequestBytes > 0 && l.maxRequestBytes <= wire::kMaxPayloadBytes, "segment '", name,
                  "': transport.max_request_bytes ", l.maxRequestBytes, " outside 1..", wire::kMaxPayloadBytes);
  DISTILL_CHECK_T(IpcError, l.maxResponseBytes > 0 && l.maxResponseBytes <= wire::kMaxPayloadBytes, "segment '", name,
                  "': transport.max_response_bytes ", l.maxResponseBytes, " outside 1..", wire::kMaxPayloadBytes);
  DISTILL_CHECK_T(IpcError, l.stallTimeoutMs > 0, "segment '", name, "': transport.stall_timeout_s ",
                  l.stallTimeoutMs, " ms must be > 0");
  DISTILL_CHECK_T(IpcError, l.heartbeatMs > 0, "segment '", name, "': transport.heartbeat_ms ", l.heartbeatMs,
                  " must be > 0");
}

void initControl(wire::ControlBlock* c, const SegmentLayout& layout, const std::string& jobId, const LayoutOffsets& off,
                 int creatorPid) {
  c->layoutVersion = wire::kLayoutVersion;
  std::strncpy(c->jobId, jobId.c_str(), sizeof c->jobId - 1);
  c->numStudents = layout.numStudents;
  c->numTeachers = layout.numTeachers;
  c->slots = layout.slots;
  c->maxRequestBytes = layout.maxRequestBytes;
  c->maxResponseBytes = layout.maxResponseBytes;
  c->heartbeatMs = layout.heartbeatMs;
  c->stallTimeoutMs = layout.stallTimeoutMs;
  c->creatorPid = creatorPid;
  c->incarnation = std::random_device{}() | (uint64_t(std::random_device{}()) << 32) | 1;
  c->totalBytes = off.total;
  c->processTableOffset = off.processTable;
  c->statusOffset = off.status;
  c->recorderOffset = off.recorder;
  c->recorderBytesPerProcess = wire::kRecorderBytesPerProcess;
  c->ringsOffset = off.rings;
  c->requestSlotStride = off.requestSlotStride;
  c->responseSlotStride = off.responseSlotStride;
  c->ringPairStride = off.ringPairStride;
  c->configOffset = off.config;
  c->configBytesPerProcess = wire::kConfigBytesPerProcess;
  c->controlChecksum = wire::controlChecksum(*c);
}

} // namespace distill::ipc
