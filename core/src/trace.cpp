#include "distill/core/trace.h"

#include <atomic>

namespace distill::trace {
namespace {
std::atomic<Sink*> gSink{nullptr};

// The step state (trace.h).
std::atomic<int64_t> gStep{-1};
std::atomic<int64_t> gAccStep{-1};
// The newest answer the trainer took (noteAnswered), -1 = none yet.
std::atomic<int64_t> gAnsweredStep{-1};
std::atomic<int64_t> gAnsweredAccStep{-1};
} // namespace

const char* opName(Op op) {
  switch (op) {
    case Op::kNone:
      return "none";
    case Op::kAttach:
      return "attach";
    case Op::kAdmission:
      return "admission";
    case Op::kSend:
      return "send";
    case Op::kReceive:
      return "receive";
    case Op::kRequest:
      return "request";
    case Op::kReply:
      return "reply";
    case Op::kForward:
      return "forward";
    case Op::kCollective:
      return "collective";
    case Op::kCheckpoint:
      return "checkpoint";
  }
  return "unknown";
}

void setSink(Sink* sink) { gSink.store(sink, std::memory_order_release); }

void clearSink(Sink* sink) {
  Sink* expected = sink;
  gSink.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel);
}

Sink* sink() { return gSink.load(std::memory_order_acquire); }

void setCurrentStep(int64_t step, int64_t accStep) {
  gAccStep.store(accStep, std::memory_order_relaxed);
  gStep.store(step, std::memory_order_relaxed);
}

void noteAnswered(int64_t step, int64_t accStep) {
  gAnsweredAccStep.store(accStep, std::memory_order_relaxed);
  gAnsweredStep.store(step, std::memory_order_relaxed);
  setCurrentStep(step, accStep);
}

void noteStepOpens(int64_t microBatches) {
  const int64_t step = gAnsweredStep.load(std::memory_order_relaxed);
  if (step >= 0 && gAnsweredAccStep.load(std::memory_order_relaxed) + 1 >= microBatches) setCurrentStep(step + 1, 0);
}

bool currentStep(int64_t* step, int64_t* accStep) {
  int64_t s = gStep.load(std::memory_order_relaxed);
  if (s < 0) return false;
  *step = s;
  *accStep = gAccStep.load(std::memory_order_relaxed);
  return true;
}

} // namespace distill::trace
