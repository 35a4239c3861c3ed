#pragma once

// The flight recorder of one process: a ring of its recent events in its own
// area of the segment (wire::RecorderArea), written only by that process and
// read by anyone (distill-run's watchdog and hang table, tests).
//
// Writer (the owning process, one thread, see core/trace.h): begin() fills the
// next event slot as a seqlock — number = 0, release fence, fields, number = n
// (release) — and end() stores the event's end time. Reader: loads number
// (acquire), the fields, an acquire fence, number again; an event whose number
// changed was overwritten while read and is skipped. Nothing blocks: a dead
// writer leaves at worst one event that reads as open.

#include <cstdint>
#include <string>
#include <vector>

#include "distill/core/trace.h"
#include "wire.h"

namespace distill::ipc {

class Recorder final : public trace::Sink {
 public:
  explicit Recorder(wire::RecorderArea* area) : area_(area) {}
  // Starts a fresh history (a new incarnation of the process attached).
  void reset();

  uint64_t begin(const trace::Event& e) override;
  void end(uint64_t token) override;
  // An event that ends now and began at `startNs` (monotonicNs(); 0 = now).
  // Ring operations (send, receive, request, reply) are recorded this way, once
  // done; a wait in progress shows in the process table instead.
  void complete(trace::Op op, int peer, int64_t step, int64_t accStep, uint64_t seq, int64_t startNs = 0,
                const char* label = "");

 private:
  wire::RecorderEvent& slot(uint64_t number) const { return area_->events[(number - 1) % wire::kRecorderEvents]; }
  uint64_t start(trace::Op op, int peer, int64_t step, int64_t accStep, uint64_t seq, const char* label, size_t len,
                 int64_t startNs);

  // Only the owner writes it: a load and a store, no read-modify-write.
  void bumpProgress() {
    area_->progress.store(area_->progress.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

  wire::RecorderArea* area_;
  uint64_t next_ = 1; // number of the next event (numbers start at 1; 0 marks a slot being written)
};

// One event as read back.
struct RecordedEvent {
  uint64_t number = 0; // 1-based position in the process's history
  trace::Op op = trace::Op::kNone;
  int peer = -1;
  int64_t step = -1, accStep = -1;
  uint64_t seq = 0;
  int64_t startNs = 0;
  int64_t endNs = 0; // 0 = still open
  std::string label;
  bool open() const { return endNs == 0; }
};

// The newest `last` events of `area` that read consistently, oldest first.
std::vector<RecordedEvent> readEvents(const wire::RecorderArea& area, int last);

} // namespace distill::ipc
