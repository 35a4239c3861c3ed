#pragma once

// The teacher server's taken requests (server.cpp): what it holds of each
// until it answers, and what becomes of them when the teacher fails.

#include <ATen/Tensor.h>

#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "distill/ipc/channel.h"
#include "distill/ipc/segment.h"

namespace distill {

struct Pending {
  ipc::ReceivedMessage msg;
  int student = 0;
  int64_t tokens = 0;
  std::vector<at::Tensor> inputs; // views into the request slot
  at::Tensor ids; // the ids it asks an answer at (protocol::kRequestIds, request.h), or undefined
};

// Requests this teacher took but has not answered, when it fails (an
// exception leaves the scope): abandoned, not freed, so that a restarted
// incarnation (teacher.max_restarts) finds them at the front of their rings and
// serves them (ipc/src/replay.h). Freeing them (ReceivedMessage's destructor)
// would leave their students waiting for answers no one owes.
template <typename Requests>
class AbandonOnFailure {
 public:
  explicit AbandonOnFailure(Requests& requests) : requests_(requests), uncaught_(std::uncaught_exceptions()) {}
  ~AbandonOnFailure() {
    if (std::uncaught_exceptions() > uncaught_)
      for (auto& p : requests_) p.msg.abandon();
  }
  AbandonOnFailure(const AbandonOnFailure&) = delete;
  AbandonOnFailure& operator=(const AbandonOnFailure&) = delete;

 private:
  Requests& requests_;
  int uncaught_;
};

// An exception's text in one line: a Python exception's type and message
// without its traceback (its first line); a TorchScript model's error without
// the interpreter's preamble and traceback (its last line); anything else's
// first line, without C++ source locations.
std::string exceptionLine(const std::string& text);

// Sampled answers: the key of each row of the batch (answer/answer.h's sampleKey of run.seed, the
// student, the tag and the row), int64 [rows of the whole batch], CPU.
at::Tensor sampleKeys(const std::vector<Pending>& batch, int64_t seed);
// The same for the rows the teacher cache computes (TeacherCache::computingRows: (request, row)
// of `batch`, in order), so that a row draws the same ids with the cache as without; with
// `positions` (teacher.cache.keys prefix: flat indices i * T + t into those rows) one key per
// position, whose draws at position 0 are its row's at t (answer.h's positionSampleKey).
at::Tensor sampleKeys(const std::vector<Pending>& batch, int64_t seed,
                      const std::vector<std::pair<size_t, int64_t>>& rows, const at::Tensor& positions);

// Notes in the rings which requests the failed batch held: the oldest of
// each student's (the one that student awaits, first in its ring again after
// a restart). One already noted failed in an earlier incarnation too: a
// failure that repeats on the same input (a bug in the model, a bad
// request) is not transient, so this teacher gives up instead of restarting
// into the same failure until teacher.max_restarts runs out: distill-run
// does not restart it, its students stop waiting, and the summary's headline
// names the request, its student and the exception.
void giveUpIfRepeated(std::vector<Pending>& batch, const std::string& what, int teacher, const ipc::Segment& segment);

} // namespace distill
