#include "ring.h"

namespace distill::ipc {

RingSide::RingSide(const SegmentImpl& seg, int student, bool response)
    : seg_(&seg),
      hdr_(&seg.ring(student, response)),
      student_(student),
      response_(response),
      slots_(seg.layout.slots),
      released_(size_t(seg.layout.slots), 0) {
  // A consumer that (re)attaches starts at the oldest unreleased message.
  readNext_ = hdr_->tail.load(std::memory_order_acquire);
}

void RingSide::publish(int consumerIndex) const {
  hdr_->head.store(head() + 1, std::memory_order_release);
  seg_->notify(consumerIndex);
}

void RingSide::release(uint64_t seq, int producerIndex) {
  uint64_t tail = hdr_->tail.load(std::memory_order_relaxed);
  if (seq < tail || seq >= readNext_) return; // not held (double release)
  released_[seq % uint64_t(slots_)] = 1;
  const uint64_t oldTail = tail;
  while (tail < readNext_ && released_[tail % uint64_t(slots_)]) {
    released_[tail % uint64_t(slots_)] = 0;
    ++tail;
  }
  if (tail != oldTail) {
    hdr_->tail.store(tail, std::memory_order_release);
    seg_->notify(producerIndex);
  }
}

} // namespace distill::ipc
