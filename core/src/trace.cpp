#include "distill/core/trace.h"

#include <atomic>

namespace distill::trace {
namespace {
std::atomic<Sink*> gSink{nullptr};
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

} // namespace distill::trace
