#pragma once

// distill::GradientSync: the students' gradient all-reduce overlapped with
// backward, the way DDP's Reducer does it, on the student group.
//
//   distill::GradientSync sync(group, model->parameters());     // hooks on every parameter
//   for (acc = 0; acc < G; ++acc) {
//     sync.setSyncing(acc + 1 == G);   // accumulation micro-batches only accumulate (DDP's no_sync)
//     loss(acc).backward();            // the last one starts bucket all-reduces as gradients land
//   }
//   sync.wait();                       // every bucket reduced, .grad() holds the sum over students
//   optimizer.step();
//
// Buckets of about `bucketMb` MiB are formed in the reverse order of `params`
// (backward produces a model's last gradients first) and launched in bucket
// order on every rank as soon as each of their gradients has been accumulated
// (a post-accumulate-grad hook per parameter), so the transfer of the last
// layers' gradients runs while autograd computes the first layers'. The
// reduction is a SUM, like allReduceGradients (grad.h): with distillLoss
// normalised by the step's global token count (stepTokenCount), the summed
// gradient is that of the whole step's tokens as one batch. ReduceOp::kAvg
// gives DDP's average instead (for a loss that is a mean per student).
//
// A parameter without a gradient when wait() is called is left out on every
// rank alike (as in allReduceGradients): every student must have the same
// parameters with gradients. One GradientSync per set of parameters: a
// parameter holds one post-accumulate-grad hook, and a second is refused.
// Each bucket's wait is bounded by run.collective_timeout_s and names the
// ranks that never entered it (StudentGroup).

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "distill/group/student_group.h"

namespace distill {

class GradientSync {
 public:
  GradientSync(StudentGroup& group, const std::vector<at::Tensor>& params, double bucketMb = 25,
               ReduceOp op = ReduceOp::kSum);
  // Removes its hooks; a reduce still under way is waited for (no transfer
  // outlives the gradients it writes).
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  // Whether the next backward all-reduces (true, the default) or only
  // accumulates into .grad() (false: an accumulation micro-batch).
  void setSyncing(bool on);
  bool syncing() const;

  // After the syncing backward: starts the buckets backward did not complete
  // (their parameters got no gradient), waits for every bucket and writes the
  // reduced gradients into .grad(). Before clipping and the optimizer step.
  void wait();

  int buckets() const;
  // Buckets started from the hooks, during backward, in the last syncing
  // backward (the rest were started by wait()).
  int startedDuringBackward() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace distill
