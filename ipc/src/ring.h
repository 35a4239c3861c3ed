#pragma once

// One side of one single-producer single-consumer ring of the segment, and
// which process is at the other end of a ring. Internal to ipc/ (no torch).
//
// A ring carries one student's requests to its teacher (request ring) or the
// teacher's responses back (response ring); layout in wire.h (RingHeader, slots).
// head and tail are each stored only by their owner (producer: head, consumer:
// tail), so a plain load + store suffices; the release stores pair with the
// other side's acquire loads, and every store that can end a wait is followed
// by SegmentImpl::notify (the doorbell protocol of port.h, "Waiting without
// lost wake-ups").

#include <cstdint>
#include <vector>

#include "segment_impl.h"

namespace distill::ipc {

// The process index of the teacher that serves local student `student`: the
// node's students dealt round robin over its teachers (teacher.procs K),
// student i to teacher i % K, so loads differ by at most one student. The
// same rule as Topology::teacherLocalRankOf (core), which the launcher shows
// in --dry-run; tests check the two agree.
inline int teacherOf(const SegmentImpl& seg, int student) { return seg.teacherIndex(student % seg.numTeachers()); }

// The local students whose rings process `teacher` serves, in index order.
inline std::vector<int> studentsServedBy(const SegmentImpl& seg, int teacher) {
  std::vector<int> out;
  for (int i = 0; i < seg.layout.numStudents; ++i)
    if (teacherOf(seg, i) == teacher) out.push_back(i);
  return out;
}

// One side of one SPSC ring, with the side's process-local cursor.
//   producer: acquire() -> write header + payload -> publish()
//   consumer: peek() -> read -> release(seq) (out of order allowed; tail
//             advances over the contiguous released prefix)
// head/tail are only ever stored by their owner, so plain load+store suffice.
class RingSide {
 public:
  RingSide(const SegmentImpl& seg, int student, bool response);

  // Producer side ------------------------------------------------------------
  // True if a slot is free (head - tail < slots); acquire load of tail pairs
  // with the consumer's release of the slot, so its reads are complete.
  bool canWrite() const { return head() - hdr_->tail.load(std::memory_order_acquire) < uint64_t(slots_); }
  uint64_t writeSeq() const { return head(); }
  // Makes slot writeSeq() visible to the consumer (release), then wakes it.
  void publish(int consumerIndex) const;

  // Consumer side ------------------------------------------------------------
  // True if a message at readNext_ is published (acquire pairs with publish).
  bool canRead() const { return readNext_ < hdr_->head.load(std::memory_order_acquire); }
  uint64_t readSeq() const { return readNext_; }
  void consumed() { ++readNext_; }
  // Frees the slot of sequence `seq` (after the consumer's last read of it);
  // tail moves with release; wakes the producer.
  void release(uint64_t seq, int producerIndex);
  // Request rings, teacher: notes that a forward raised on request `seq`;
  // true if that request was already so noted (by an earlier incarnation, or
  // an earlier batch of this one): the failure repeats on the same input.
  bool markFailed(uint64_t seq) const { return hdr_->failedSeq.exchange(seq + 1, std::memory_order_acq_rel) == seq + 1; }
  uint64_t held() const { return readNext_ - hdr_->tail.load(std::memory_order_relaxed); }

  wire::SlotHeader* slot(uint64_t seq) const { return seg_->slot(student_, response_, seq % uint64_t(slots_)); }
  uint8_t* payload(uint64_t seq) const { return seg_->payload(student_, response_, seq % uint64_t(slots_)); }
  int64_t capacity() const { return seg_->capacity(response_); }
  int slots() const { return slots_; }
  int student() const { return student_; }
  bool response() const { return response_; }

 private:
  uint64_t head() const { return hdr_->head.load(std::memory_order_relaxed); }

  const SegmentImpl* seg_;
  wire::RingHeader* hdr_;
  int student_;
  bool response_;
  int slots_;
  uint64_t readNext_ = 0;
  std::vector<char> released_; // consumer: slot released out of order, tail not yet past it
};

} // namespace distill::ipc
