// The flag page's host logic; see flag_page.h. Pure C++, built with or without CUDA.
#include "flag_page.h"

#include <cstring>

namespace distill::ipc::cuda {

const char* signalName(Signal s) {
  switch (s) {
    case Signal::kUndecided:
      return "undecided";
    case Signal::kEvents:
      return "interprocess CUDA events";
    case Signal::kMemOps:
      return "stream memory operations on the flag page";
  }
  return "unknown";
}

bool parseSignalRequest(const char* value, SignalRequest* out, std::string* bad) {
  if (!value || !*value || std::strcmp(value, "auto") == 0) {
    *out = SignalRequest::kAuto;
    return true;
  }
  if (std::strcmp(value, "events") == 0) {
    *out = SignalRequest::kEvents;
    return true;
  }
  *bad = value;
  return false;
}

Signal chooseSignal(const SignalInputs& in, std::string* why) {
  // The first reason that rules stream memory operations out, in the order a reader would check them.
  const char* reason = nullptr;
  if (in.request == SignalRequest::kEvents)
    reason = "DISTILL_CUDA_IPC_SIGNAL=events";
  else if (!in.pageValid)
    reason = "the consumer's buffer has no initialised flag page";
  else if (!in.entryPoints)
    reason = "the driver has no cuStreamWriteValue64/cuStreamWaitValue64 entry points";
  else if (!in.producerMemOps)
    reason = "the producer's device cannot do 64-bit stream memory operations";
  else if (!in.consumerMemOps)
    reason = "the consumer's device cannot do 64-bit stream memory operations (or the consumer asked for events)";
  else if (!in.sameDevice)
    reason = "producer and consumer are on different GPUs (a remote flag write would need a flush)";
  if (!reason) return Signal::kMemOps;
  if (why) *why = reason;
  return Signal::kEvents;
}

} // namespace distill::ipc::cuda
