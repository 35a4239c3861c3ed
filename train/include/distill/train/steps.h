#pragma once

// distill::Steps: the per-step protocol of a distill student in one object
// (docs/cpp.md, "The step API"). The trainer hands it micro-batches in its own order
// and keeps its forward, its optimizer and its schedule:
//
//   distill::Steps steps(session, *model, opt);                 // resumes from the checkpoint
//   while (auto mb = steps.next(loader)) {                      // loader: () -> optional<MicroBatch>
//     steps.backward(model->forward(mb->inputs));               // teacher's answer, loss, backward
//     // or, without [N, V] logits: steps.backward(hidden, {lmHead->weight, lmHead->bias});
//     if (steps.stepEnds()) opt.step(), opt.zero_grad();        // gradients already summed
//   }                                                           // saved, published, finished
//
// What it does for the trainer:
// - reads the loader ahead: all grad_acc_steps micro-batches of a step (their
//   labels give the step's global token count) and student.in_flight requests
//   kept with the teacher, each tagged (step, acc_step) by the object itself;
//   every answer's tag is checked against its micro-batch's;
// - distillLoss with the step's token count, backward; the students'
//   gradients are summed by a GradientSync (grad_sync.h): on the step's last
//   micro-batch its buckets are all-reduced while backward still runs, the
//   accumulation micro-batches start no collective (DDP's no_sync); by
//   stepEnds() .grad() holds the sum (StepsOptions::overlapGradients = false:
//   one allReduceGradients after the last backward instead);
// - at the next next(): one all-reduce per step carrying the loss parts and
//   the stop flag (distill-run's stop request), so every student leaves after
//   the same step; the status to distill-run (loss, kd, ce, tokens/s, teacher
//   wait share) and StepsOptions::onStep (metrics.jsonl);
// - checkpoints (CheckpointManager) when checkpoint.every_steps is due, on a
//   stop, at run.steps and when a loader runs dry (none with checkpoint.dir
//   ""); the last save is awaited (published) before next() returns nullopt,
//   and the teacher is told this student finished (finish() does the same for
//   a trainer that leaves the loop itself).
// A loader that runs dry on any student (fewer micro-batches than a step
// needs) is a stop agreed at the step's start, never a hang. run.steps > 0
// bounds the loop.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distill/ckpt/checkpoint.h"
#include "distill/core/status.h"
#include "distill/student/client.h"
#include "distill/student/grad_sync.h"
#include "distill/student/init.h"

namespace distill {

// One micro-batch of this student: the teacher's input (also the model's)
// and the labels (ignore_index where nothing is learnt).
struct MicroBatch {
  at::Tensor inputs;
  at::Tensor labels;
  // Optional (teacher.request_ids >= k): integer ids [B, T, k] to have the teacher's logits at
  // (an ids answer): the student's own top-k, or with loss.kind sampled_token the token it sampled
  // at each position (k = 1, e.g. the labels where they are not ignored).
  at::Tensor ids;
  // Optional, loss.kind sampled_token: [B, T] log-probabilities of ids[..., 0] under the policy
  // that sampled them (importance weights when the weights moved since; losses.h).
  at::Tensor samplingLogProbs;
};

// What next() hands the trainer: the micro-batch and where it stands.
struct StepItem {
  at::Tensor inputs;
  at::Tensor labels;
  int64_t step = 0; // 1-based optimizer step
  int64_t accStep = 0; // 0 .. grad_acc_steps - 1
};

// One finished step, the same on every student (loss parts summed over them).
struct StepReport {
  int64_t step = 0;
  // Over all students: the loss the step minimised and its two terms. A term of weight 0 is not
  // computed and reported as 0 (kd with loss.alpha 0, ce with loss.alpha 1): never NaN.
  double loss = 0, kd = 0, ce = 0;
  double tokens = 0; // the step's non-ignored tokens, all students
  double seconds = 0; // this student's step time
  double tokensPerS = 0; // all students (this student's x student world size)
  double teacherWaitShare = 0; // share of this student's step spent in get()
  bool stop = false; // the students agreed to stop after this step
  // loss.vocab truncate (docs/vocab.md): the teacher probability the dropped ids held, the most of
  // any token and the mean over the step's tokens, all students; -1 both with loss.vocab error.
  double truncatedMassMax = -1, truncatedMassMean = -1;
  // teacher.on_nonfinite mask: the step's tokens whose teacher answer was not finite, all students
  // (they learnt from their labels only: their kd term dropped).
  int64_t maskedTokens = 0;
  // loss.on_nonfinite skip_step: this step's loss or gradient was not finite on some student, and
  // Steps left every parameter without a gradient (.grad undefined: the optimizer's step changes
  // nothing; with setLossScale, filled with NaN for the scaler to skip); skippedSteps counts them
  // since this run started, all students alike.
  bool skipped = false;
  int64_t skippedSteps = 0;
};

// One checkpoint the step API took (StepsOptions::onCheckpoint).
struct CheckpointReport {
  int64_t step = 0;
  // CheckpointManager::save()'s verdict: true when it is published (sync) or
  // handed to the background writer with the previous one published (async).
  bool saved = false;
  // Why it failed ("" when saved): CheckpointManager::lastError(), naming the
  // file and strerror(errno) on the rank that failed, and what is left in place.
  std::string error;
};

struct StepsOptions {
  // Names the teacher in the checkpoints (a mismatch on load is a warning).
  std::string teacherFingerprint;
  // Called on every student after each step (metrics, validation, logging);
  // after the optimizer step, before the step's checkpoint.
  std::function<void(const StepReport&)> onStep;
  // Adds to the published status (e.g. a field a later version reports).
  std::function<void(StudentStatus&)> onStatus;
  // TrainState::extra of each checkpoint (the trainer's own resume bytes).
  std::function<std::string()> checkpointExtra;
  // RankState::extra of each checkpoint: this rank's own resume bytes (its
  // loader's position), in this rank's file. Called with the step saved.
  std::function<std::string(int64_t step)> checkpointRankExtra;
  // After each save (never with checkpoint.dir "": nothing is saved). A
  // failed one (checkpoint.on_error=continue) says which file and why.
  std::function<void(const CheckpointReport&)> onCheckpoint;
  // Overlap the gradient all-reduce with backward (GradientSync, hooks on the
  // model's parameters); false: all-reduce after the step's last backward.
  // The same sums either way (tests/student/grad_test.cpp).
  bool overlapGradients = true;
};

// A trainer whose model is not a torch::nn::Module (the Python binding gives
// one): Steps reaches its model and optimizer only through these.
struct ExternalModel {
  std::vector<at::Tensor> parameters; // broadcast from student rank 0 at start; their gradients summed
  std::vector<at::Tensor> buffers; // broadcast at start
  // The trainer sums the gradients itself with an averaging all-reduce (DDP):
  // Steps starts no gradient collective and backpropagates the loss times the
  // student world size, so the average is the sum Steps would give.
  bool trainerAverages = false;
  bool cuda = false; // the model is on a GPU (checkpoints save the CUDA generators)
  // model.pt's and optimizer.pt's bytes now (a checkpoint), and loading them back.
  std::function<std::pair<std::string, std::string>()> saveState;
  std::function<void(const std::string& model, const std::string& optimizer)> loadState;
};

// The student's output projection (its lm_head: logits = hidden @ weight.T +
// bias) for Steps::backward(hidden, head): the loss is then fusedLinearLoss
// (losses.h), which never holds the [N, V] logits.
struct OutputHead {
  at::Tensor weight; // [V, d]
  at::Tensor bias; // [V], or undefined (no bias)
  int64_t chunkTokens = 0; // tokens per chunk of fusedLinearLoss (0: automatic)
};

class Steps {
 public:
  using Loader = std::function<std::optional<MicroBatch>()>;

  // Collective (all students): builds the CheckpointManager of
  // session.config.checkpoint and loads the latest checkpoint into `model`
  // and `optimizer`; training goes on at resumedStep() + 1.
  Steps(Session& session, torch::nn::Module& model, torch::optim::Optimizer& optimizer, StepsOptions options = {});
  // The same for a model Steps reaches through `model`'s functions.
  Steps(Session& session, ExternalModel model, StepsOptions options = {});
  ~Steps();
  Steps(const Steps&) = delete;
  Steps& operator=(const Steps&) = delete;

  // The step the checkpoint loaded had finished (0: a clean start), and its
  // TrainState::extra.
  int64_t resumedStep() const;
  const std::string& resumedExtra() const;
  const std::string& resumedRankExtra() const; // RankState::extra

  // The next micro-batch, or nullopt when training is over (run.steps done,
  // a stop agreed, a loader dry): then the last checkpoint is published and
  // the teacher told. Collective at each step's boundary.
  std::optional<StepItem> next(const Loader& loader);
  // For a trainer that leaves the loop itself (run.steps 0) after a step's
  // optimizer step: what next() does when training is over — the step closed,
  // saved and published, the teacher told. Collective (every student, after
  // the same step). A no-op once next() returned nullopt. Left out, the
  // destructor warns when checkpoints are on and the last steps are in none.
  void finish();
  // The teacher's answer for the current micro-batch, distillLoss with the
  // step's token count, backward; after the step's last micro-batch the
  // students' gradients are summed. Returns the loss parts of this call.
  LossResult backward(const at::Tensor& logits);
  // The same from the model's last hidden states [..., d] and its output
  // projection: fusedLinearLoss instead of distillLoss (same value and
  // gradients; no [N, V] logits nor their gradient in memory).
  LossResult backward(const at::Tensor& hidden, const OutputHead& head);
  // Multiplies the loss of the next backward() calls before their backward:
  // a loss scaler's scale for fp16 (a 0-dim tensor on the loss's device;
  // undefined: 1). The reported losses stay unscaled.
  void setLossScale(at::Tensor scale);
  // True after backward() of the step's last micro-batch: step the optimizer.
  bool stepEnds() const;

  int64_t step() const; // the current step
  double stepTokens() const; // its global token count
  bool stopped() const; // ended before run.steps by a stop or a dry loader
  // The last save and its publication succeeded (true when none was made:
  // checkpoint.dir ""); saveError() says why one failed.
  bool saved() const;
  const std::string& saveError() const;
  const StepReport& last() const; // the last finished step
  CheckpointManager& checkpoints();

 private:
  // The state and the protocol (train/src/steps.cpp): none of it is the trainer's.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace distill
