#include "replay.h"

#include "distill/core/logging.h"

namespace distill::ipc {

Replay Replay::plan(const std::vector<RingSide>& in, const std::vector<RingSide>& out, const std::string& self) {
  Replay p;
  for (size_t r = 0; r < in.size(); ++r) {
    const uint64_t answered = out[r].writeSeq();
    p.answered_.push_back(answered);
    const uint64_t unfreed = answered > in[r].readSeq() ? answered - in[r].readSeq() : 0;
    if (unfreed > 0) {
      DISTILL_LOG(kWarning) << self << ": student local " << in[r].student() << ": " << unfreed
                            << " request(s) answered by the previous teacher incarnation are still in the ring;"
                            << " freeing them unanswered";
    }
  }
  return p;
}

} // namespace distill::ipc
