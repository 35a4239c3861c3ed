#pragma once

// Internal view of a mapped segment: typed accessors over the offsets recorded
// in the control block (wire.h). No Boost here; the mapping itself is owned
// through the opaque `mapping` pointer (segment.cpp); the layout's arithmetic
// and checks are segment_layout.cpp's.

#include <cstdint>
#include <memory>
#include <string>

#include "distill/ipc/segment.h"
#include "wire.h"

namespace distill::ipc {

// Offsets derived from a layout; create() writes them, attach() recomputes and compares.
struct LayoutOffsets {
  uint64_t processTable, status, recorder, config, rings, requestSlotStride, responseSlotStride, requestRingBytes,
      responseRingBytes, ringPairStride, total;
};
LayoutOffsets computeOffsets(const SegmentLayout& l);
// IpcError naming segment `name` when a count or size of `l` is out of range (segment_layout.cpp).
void checkLayout(const SegmentLayout& l, const std::string& name);
// The control block's fields (all but magic, which publishes it): the layout, the job, the offsets.
void initControl(wire::ControlBlock* c, const SegmentLayout& layout, const std::string& jobId, const LayoutOffsets& off,
                 int creatorPid);

struct SegmentImpl {
  std::string name;
  std::shared_ptr<void> mapping; // keeps the Boost mapping alive
  uint8_t* base = nullptr;
  size_t size = 0;
  SegmentLayout layout;
  LayoutOffsets off{};

  wire::ControlBlock& control() const { return *reinterpret_cast<wire::ControlBlock*>(base); }
  int numProcesses() const { return layout.numStudents + layout.numTeachers; }
  int numTeachers() const { return layout.numTeachers; }
  // Process index of teacher t (0 .. numTeachers-1); whether process i is a teacher.
  int teacherIndex(int t) const { return layout.numStudents + t; }
  bool isTeacher(int index) const { return index >= layout.numStudents && index < numProcesses(); }
  // The state of the teacher at process index `index` (isTeacher(index)).
  wire::ControlBlock::TeacherState& teacherState(int index) const {
    return control().teachers[index - layout.numStudents];
  }
  wire::ProcessEntry& process(int index) const {
    return reinterpret_cast<wire::ProcessEntry*>(base + off.processTable)[index];
  }
  wire::StatusArea& status(int index) const { return reinterpret_cast<wire::StatusArea*>(base + off.status)[index]; }
  wire::RecorderArea& recorder(int index) const {
    return *reinterpret_cast<wire::RecorderArea*>(base + off.recorder +
                                                  uint64_t(index) * wire::kRecorderBytesPerProcess);
  }
  wire::ConfigArea& config(int index) const {
    return *reinterpret_cast<wire::ConfigArea*>(base + off.config + uint64_t(index) * wire::kConfigBytesPerProcess);
  }
  uint64_t ringOffset(int student, bool response) const {
    return off.rings + uint64_t(student) * off.ringPairStride + (response ? off.requestRingBytes : 0);
  }
  wire::RingHeader& ring(int student, bool response) const {
    return *reinterpret_cast<wire::RingHeader*>(base + ringOffset(student, response));
  }
  // The `slots` CUDA event handles after a ring header.
  char* ringEvents(int student, bool response) const {
    return reinterpret_cast<char*>(base + ringOffset(student, response) + sizeof(wire::RingHeader));
  }
  wire::SlotHeader* slot(int student, bool response, uint64_t index) const {
    uint64_t stride = response ? off.responseSlotStride : off.requestSlotStride;
    return reinterpret_cast<wire::SlotHeader*>(base + ringOffset(student, response) + sizeof(wire::RingHeader) +
                                               wire::ringEventsBytes(layout.slots) + index * stride);
  }
  uint8_t* payload(int student, bool response, uint64_t index) const {
    return reinterpret_cast<uint8_t*>(slot(student, response, index)) + wire::kSlotHeaderBytes;
  }
  int64_t capacity(bool response) const { return response ? layout.maxResponseBytes : layout.maxRequestBytes; }
  // Wakes the owner of process entry `index` if it sleeps on its doorbell.
  // Call after making the awaited change visible (release store).
  void notify(int index) const;
  void notifyAll() const;
};

} // namespace distill::ipc
