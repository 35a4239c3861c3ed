#pragma once

// The elastic teacher's replay: what a new teacher incarnation does with the
// requests it finds in the rings when it attaches (the launcher restarts a dead
// teacher, teacher.max_restarts; the students keep their rings and wait).
//
// Why it is exact: a teacher answers each student's requests in ring order,
// one response each, and frees a request slot only after it answered it. So,
// when an incarnation attaches, the head of a student's response ring is the
// number of that student's requests already answered (by this or an earlier
// incarnation). Of the requests still in the request ring, those below that
// number were answered by a teacher that died before freeing them: they are
// freed unanswered (skipped). The rest are served as usual. No request is
// lost, none is answered twice, and the student sees one answer per request.
//
// A first incarnation finds every count at the request ring's tail and skips
// nothing. Students need no replay: their cursors are their own.

#include <cstdint>
#include <string>
#include <vector>

#include "ring.h"

namespace distill::ipc {

class Replay {
 public:
  Replay() = default; // nothing to skip (a student's end)
  // At a teacher's attach: per ring r (in[r] its request ring, out[r] the
  // response ring of the same student), the requests already answered. Logs
  // a warning naming each student whose ring holds answered requests.
  static Replay plan(const std::vector<RingSide>& in, const std::vector<RingSide>& out, const std::string& self);

  // Frees, unanswered, the requests at ring `in`'s read cursor that an earlier
  // incarnation answered (ring r of plan()); `producer`: the student's process
  // index (woken when a slot frees). Call before each read of the ring.
  void skipAnswered(int r, RingSide& in, int producer) const {
    if (answered_.empty()) return;
    while (in.canRead() && in.readSeq() < answered_[size_t(r)]) {
      const uint64_t seq = in.readSeq();
      in.consumed();
      in.release(seq, producer);
    }
  }

 private:
  std::vector<uint64_t> answered_; // per ring: the response ring's head at attach
};

} // namespace distill::ipc
