#include "recorder.h"

#include <algorithm>
#include <cstring>

#include "distill/core/clock.h"

namespace distill::ipc {

void Recorder::reset() {
  // A restarted process starts a new history; readers see no event until the
  // first begin() (begun == 0) and old slots are overwritten before use.
  for (auto& e : area_->events) e.number.store(0, std::memory_order_relaxed);
  area_->lastEndNs.store(monotonicNs(), std::memory_order_relaxed);
  area_->begun.store(0, std::memory_order_release);
  next_ = 1;
}

uint64_t Recorder::start(trace::Op op, int peer, int64_t step, int64_t accStep, uint64_t seq, const char* label,
                         size_t len, int64_t startNs) {
  const uint64_t n = next_++;
  auto& e = slot(n);
  e.number.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release); // readers of the old event see the change
  e.op.store(uint32_t(op), std::memory_order_relaxed);
  e.peer.store(peer, std::memory_order_relaxed);
  e.step.store(step, std::memory_order_relaxed);
  e.accStep.store(accStep, std::memory_order_relaxed);
  e.seq.store(seq, std::memory_order_relaxed);
  e.startNs.store(startNs ? startNs : monotonicNs(), std::memory_order_relaxed);
  e.endNs.store(0, std::memory_order_relaxed);
  len = std::min(len, sizeof(uint64_t) * wire::kRecorderLabelWords - 1);
  for (int w = 0; w < wire::kRecorderLabelWords; ++w) {
    uint64_t word = 0;
    const size_t from = size_t(w) * sizeof word;
    if (from < len) std::memcpy(&word, label + from, std::min(sizeof word, len - from));
    e.label[w].store(word, std::memory_order_relaxed);
    if (from + sizeof word > len) break; // the word holding the NUL is written; readers stop there
  }
  e.number.store(n, std::memory_order_release);
  area_->begun.store(n, std::memory_order_release);
  bumpProgress();
  return n;
}

uint64_t Recorder::begin(const trace::Event& e) {
  return start(e.op, e.peer, e.step, e.accStep, e.seq, e.label.data(), e.label.size(), 0);
}

void Recorder::end(uint64_t token) {
  if (token == 0) return;
  const int64_t now = monotonicNs();
  auto& e = slot(token);
  if (e.number.load(std::memory_order_relaxed) == token) e.endNs.store(now, std::memory_order_relaxed);
  area_->lastEndNs.store(now, std::memory_order_relaxed);
  bumpProgress();
}

void Recorder::complete(trace::Op op, int peer, int64_t step, int64_t accStep, uint64_t seq, int64_t startNs,
                        const char* label) {
  end(start(op, peer, step, accStep, seq, label, std::strlen(label), startNs));
}

std::vector<RecordedEvent> readEvents(const wire::RecorderArea& area, int last) {
  std::vector<RecordedEvent> out;
  const uint64_t begun = area.begun.load(std::memory_order_acquire);
  const uint64_t first = begun > uint64_t(last) ? begun - uint64_t(last) + 1 : 1;
  for (uint64_t n = first; n <= begun && n > 0; ++n) {
    const auto& e = area.events[(n - 1) % wire::kRecorderEvents];
    if (e.number.load(std::memory_order_acquire) != n) continue;
    RecordedEvent r;
    r.number = n;
    r.op = trace::Op(e.op.load(std::memory_order_relaxed));
    r.peer = e.peer.load(std::memory_order_relaxed);
    r.step = e.step.load(std::memory_order_relaxed);
    r.accStep = e.accStep.load(std::memory_order_relaxed);
    r.seq = e.seq.load(std::memory_order_relaxed);
    r.startNs = e.startNs.load(std::memory_order_relaxed);
    r.endNs = e.endNs.load(std::memory_order_relaxed);
    char label[sizeof(uint64_t) * wire::kRecorderLabelWords + 1] = {};
    for (int w = 0; w < wire::kRecorderLabelWords; ++w) {
      const uint64_t word = e.label[w].load(std::memory_order_relaxed);
      std::memcpy(label + size_t(w) * sizeof word, &word, sizeof word);
      if (std::memchr(&word, 0, sizeof word)) break;
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e.number.load(std::memory_order_relaxed) != n) continue; // overwritten while read
    r.label = label;
    out.push_back(std::move(r));
  }
  return out;
}

} // namespace distill::ipc
