// distill::Steps: the per-step protocol of a student (docs/cpp.md, "The step API").
#include "distill/train/steps.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <exception>

#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/trace.h"
#include "distill/loss/hidden_head.h"
#include "distill/loss/losses.h"
#include "distill/student/grad.h"
#include "nonfinite.h"

namespace distill {

namespace {
std::string mbName(int64_t step, int64_t acc) {
  return "(step " + std::to_string(step) + ", acc_step " + std::to_string(acc) + ")";
}
} // namespace

// Everything a Steps holds; its methods are the protocol, Steps forwards to them.
struct Steps::Impl {
  Impl(Session& session, torch::nn::Module& model, torch::optim::Optimizer& optimizer, StepsOptions options);
  Impl(Session& session, ExternalModel model, StepsOptions options);
  ~Impl();

  std::optional<StepItem> next(const Loader& loader);
  void finish();
  LossResult backward(const at::Tensor& logits);
  LossResult backward(const at::Tensor& hidden, const OutputHead& head);
  bool stepEnds() const;

  struct Pending {
    MicroBatch mb;
    int64_t step = 0, accStep = 0;
    std::optional<Handle> handle;
  };
  using LossFn = train_impl::LossFn;
  using RowsFn = train_impl::RowsFn;
  LossResult backwardWith(const LossFn& loss, const RowsFn& rows);
  bool fill(const Loader& loader, size_t count);
  void submitAhead();
  // A micro-batch's request: its inputs, and the ids it asks an answer at.
  Handle submit(const Pending& p) {
    std::vector<std::pair<std::string, at::Tensor>> named{{session_.config.teacher.inputs.at(0), p.mb.inputs}};
    if (p.mb.ids.defined()) named.emplace_back(protocol::kRequestIds, p.mb.ids);
    return session_.client->submit(named, p.step, p.accStep);
  }
  bool openStep(const Loader& loader);
  void finishStep();
  void syncGradients();
  void checkFinite(int64_t step, int64_t accStep);
  bool save(int64_t step);
  void end();
  void start(const std::vector<at::Tensor>& buffers);

  Session& session_;
  torch::nn::Module* model_ = nullptr; // or external_
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::optional<ExternalModel> external_;
  StepsOptions options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<CheckpointManager> ckpt_;
  std::unique_ptr<GradientSync> sync_; // null without StepsOptions::overlapGradients
  std::deque<Pending> queue_; // read ahead, in order; front: the current micro-batch once taken
  std::optional<Pending> current_;
  int grad_acc_ = 1;
  int64_t resumed_ = 0, step_ = 0, accStep_ = -1, nextStep_ = 1, nextAcc_ = 0, savedStep_ = -1;
  std::string resumedExtra_, resumedRankExtra_, saveError_;
  bool saveOk_ = true, dry_ = false, done_ = false, stopped_ = false, stepOpen_ = false;
  double tokens_ = 0, loss_ = 0, kd_ = 0, ce_ = 0, wait_ = 0, myTokens_ = 0;
  double massMax_ = 0, massSum_ = 0; // loss.vocab truncate: this student's, this step
  double masked_ = 0, maskedTotal_ = 0; // teacher.on_nonfinite mask: tokens, this step and in all
  bool skip_ = false; // loss.on_nonfinite skip_step: this step's update is skipped
  int64_t skipped_ = 0; // steps skipped since this run started
  int64_t stepStartNs_ = 0;
  StepReport last_;
  at::Tensor lossScale_; // setLossScale()
};

Steps::Impl::Impl(Session& session, torch::nn::Module& model, torch::optim::Optimizer& optimizer, StepsOptions options)
    : session_(session), model_(&model), optimizer_(&optimizer), options_(std::move(options)) {
  params_ = model.parameters();
  start(model.buffers());
}

Steps::Impl::Impl(Session& session, ExternalModel model, StepsOptions options)
    : session_(session), external_(std::move(model)), options_(std::move(options)) {
  DISTILL_CHECK_T(UsageError, external_->saveState && external_->loadState,
                  "distill::Steps: an ExternalModel needs saveState and loadState");
  params_ = external_->parameters;
  if (external_->trainerAverages) options_.overlapGradients = false;
  start(external_->buffers);
}

// Both constructors: the checkpoint loaded, student rank 0's weights everywhere.
void Steps::Impl::start(const std::vector<at::Tensor>& buffers) {
  DISTILL_CHECK_T(UsageError, session_.student && session_.client,
                  "distill::Steps needs a student session (this rank is the teacher)");
  grad_acc_ = session_.config.student.grad_acc_steps;
  ckpt_ =
      std::make_unique<CheckpointManager>(*session_.student, session_.config.checkpoint, options_.teacherFingerprint);
  std::optional<LoadedState> loaded;
  if (model_) {
    loaded = ckpt_->loadLatest(*model_, *optimizer_);
  } else {
    std::string modelBytes, optimizerBytes;
    loaded = ckpt_->loadLatestBytes(modelBytes, optimizerBytes, external_->cuda);
    if (loaded) external_->loadState(modelBytes, optimizerBytes);
  }
  if (loaded) {
    resumed_ = loaded->train.step;
    resumedExtra_ = loaded->train.extra;
    resumedRankExtra_ = loaded->rank.extra;
  }
  // Every student trains student rank 0's weights, as DDP does at start.
  broadcastParameters(session_.student->group(), params_, buffers);
  if (options_.overlapGradients) {
    sync_ = std::make_unique<GradientSync>(session_.student->group(), params_, session_.config.student.bucket_mb);
    sync_->setSyncing(false); // set per micro-batch by backward()
  }
  step_ = savedStep_ = resumed_;
  nextStep_ = resumed_ + 1;
}

// A trainer that left the loop itself without finish(): the steps after the
// last checkpoint are in none. Said once, by student rank 0; not while an
// exception unwinds (it says what happened).
Steps::Impl::~Impl() {
  if (done_ || !ckpt_ || !ckpt_->enabled() || step_ <= savedStep_ || std::uncaught_exceptions() > 0) return;
  if (session_.student->group().rank() != 0) return;
  DISTILL_LOG(kWarning) << "distill::Steps: the trainer left the loop after step " << step_
                        << " without next() returning nullopt or finish(): steps " << savedStep_ + 1 << ".." << step_
                        << " are in no checkpoint in " << ckpt_->options().dir
                        << (savedStep_ > 0 ? " (the last one taken: step " + std::to_string(savedStep_) + ")"
                                           : " (none was taken)")
                        << "; call finish() after the loop (it saves step " << step_
                        << "), or bound it with run.steps or checkpoint.every_steps";
}

void Steps::Impl::finish() {
  if (done_) return;
  DISTILL_CHECK_T(UsageError, !current_, "distill::Steps::finish() before backward() of micro-batch ",
                  mbName(current_->step, current_->accStep));
  if (stepEnds()) finishStep(); // the step's all-reduce, its report, its checkpoint when due
  if (done_) return;
  DISTILL_CHECK_T(UsageError, !stepOpen_, "distill::Steps::finish() inside step ", step_, " (after acc_step ", accStep_,
                  "): call it once stepEnds() and the optimizer step are done");
  end();
}

// Reads the loader until `count` micro-batches are queued; never past run.steps.
bool Steps::Impl::fill(const Loader& loader, size_t count) {
  const int64_t bound = session_.config.run.steps;
  while (queue_.size() < count && !dry_ && (bound <= 0 || nextStep_ <= bound)) {
    std::optional<MicroBatch> mb = loader();
    if (!mb) {
      dry_ = true;
      break;
    }
    DISTILL_CHECK_T(UsageError, mb->inputs.defined() && mb->labels.defined(),
                    "distill::Steps: the loader's micro-batch ", mbName(nextStep_, nextAcc_),
                    " has undefined inputs or labels");
    queue_.push_back(Pending{std::move(*mb), nextStep_, nextAcc_, std::nullopt});
    if (++nextAcc_ == grad_acc_) nextAcc_ = 0, ++nextStep_;
  }
  return queue_.size() >= count;
}

// Keeps student.in_flight requests with the teacher: the current one and those read ahead.
void Steps::Impl::submitAhead() {
  if (current_ && !current_->handle)
    current_->handle = submit(*current_);
  int64_t outstanding = current_ ? 1 : 0;
  for (Pending& p : queue_) {
    if (outstanding >= session_.config.student.in_flight) break;
    if (!p.handle) p.handle = submit(p);
    ++outstanding;
  }
}

// A step's start: all its micro-batches read (their labels give the token
// count), one all-reduce carrying the token count and whether a loader ran dry.
bool Steps::Impl::openStep(const Loader& loader) {
  const int64_t bound = session_.config.run.steps;
  if (bound > 0 && step_ >= bound) return false;
  stepStartNs_ = monotonicNs();
  const bool full = fill(loader, static_cast<size_t>(grad_acc_));
  trace::noteStepOpens(grad_acc_);
  int64_t local = 0;
  myTokens_ = 0;
  for (size_t i = 0; full && i < static_cast<size_t>(grad_acc_); ++i) {
    local += countTokens(queue_[i].mb.labels, session_.config.loss.ignore_index);
    myTokens_ += static_cast<double>(queue_[i].mb.labels.numel());
  }
  at::Tensor t = at::tensor({static_cast<double>(local), full ? 0.0 : 1.0}, at::kDouble);
  session_.student->group().allReduce(t, ReduceOp::kSum, "step token count and loader state");
  const int64_t dryRanks = static_cast<int64_t>(t[1].item<double>());
  if (dryRanks > 0) {
    DISTILL_LOG(kWarning) << "the loader ran dry before step " << step_ + 1 << " on " << dryRanks << " of "
                          << session_.student->worldSize() << " students (this one: " << (full ? "not dry" : "dry")
                          << "): stopping after step " << step_;
    stopped_ = true;
    return false;
  }
  tokens_ = t[0].item<double>();
  ++step_;
  loss_ = kd_ = ce_ = wait_ = massMax_ = massSum_ = masked_ = 0;
  skip_ = false;
  stepOpen_ = true;
  return true;
}

std::optional<StepItem> Steps::Impl::next(const Loader& loader) {
  if (done_) return std::nullopt;
  DISTILL_CHECK_T(UsageError, !current_, "distill::Steps::next() before backward() of micro-batch ",
                  mbName(current_->step, current_->accStep));
  if (stepEnds()) finishStep();
  if (done_) return std::nullopt;
  if (!stepOpen_ && !openStep(loader)) {
    end();
    return std::nullopt;
  }
  current_ = std::move(queue_.front());
  queue_.pop_front();
  accStep_ = current_->accStep;
  // Read ahead for the requests kept in flight (the next step's are read
  // here too; a loader ending there is found at that step's start).
  fill(loader, static_cast<size_t>(std::max<int64_t>(0, session_.config.student.in_flight - 1)));
  submitAhead();
  return StepItem{current_->mb.inputs, current_->mb.labels, current_->step, current_->accStep};
}

namespace {
// The teacher's answer on the student's device: it arrives on the host when the teacher runs on the
// CPU for a CUDA student, or with transport.cuda_ipc off. A hidden-state answer's head (mapped on the
// host, student/teacher_head.h) comes from the client on that device: on a GPU one copy per node and
// device (Client::teacherHeadOn).
TeacherOutput onDevice(const TeacherOutput& t, const at::Device& d, Client& client) {
  TeacherOutput o = t;
  for (at::Tensor* x : o.tensors()) {
    if (x->defined() && x->device() != d) *x = x->to(d, /*non_blocking=*/true);
  }
  HiddenAnswer* h = o.hidden();
  if (!h || !h->head || h->head->weight.device() == d) return o;
  if (h->head == client.teacherHead()) h->head = client.teacherHeadOn(d);
  if (h->head->weight.device() != d) { // an answer of a head the client no longer holds (not expected)
    auto copy = std::make_shared<TeacherHead>(*h->head);
    copy->weight = copy->weight.to(d);
    if (copy->bias.defined()) copy->bias = copy->bias.to(d);
    h->head = std::move(copy);
  }
  return o;
}
} // namespace

LossResult Steps::Impl::backward(const at::Tensor& logits) {
  return backwardWith([&](const at::Tensor& labels, const TeacherOutput& teacher) {
    return distillLoss(logits, labels.to(logits.device()), onDevice(teacher, logits.device(), *session_.client),
                       session_.config.loss, tokens_);
  }, [&](const at::Tensor& index) {
    return logits.reshape({-1, logits.size(-1)}).index_select(0, index.to(logits.device()));
  });
}

LossResult Steps::Impl::backward(const at::Tensor& hidden, const OutputHead& head) {
  return backwardWith([&](const at::Tensor& labels, const TeacherOutput& teacher) {
    return fusedLinearLoss(hidden, head.weight, head.bias, labels.to(hidden.device()),
                           onDevice(teacher, hidden.device(), *session_.client), session_.config.loss, tokens_,
                           head.chunkTokens);
  }, [&](const at::Tensor& index) {
    const at::Tensor h = hidden.reshape({-1, hidden.size(-1)}).index_select(0, index.to(hidden.device()));
    return head.bias.defined() ? at::addmm(head.bias, h, head.weight.t()) : at::mm(h, head.weight.t());
  });
}

LossResult Steps::Impl::backwardWith(const LossFn& loss, const RowsFn& rows) {
  DISTILL_CHECK_T(UsageError, current_, "distill::Steps::backward() without a micro-batch: call next() first");
  const Pending p = std::move(*current_);
  current_.reset();
  const int64_t t0 = monotonicNs();
  // Client::get checks the answer's tag against the request's (a ProtocolError naming both).
  TeacherReply reply = session_.client->get(*p.handle, ReplyMode::kView); // zero copy, freed below
  wait_ += static_cast<double>(monotonicNs() - t0) * 1e-9;
  if (ckpt_) ckpt_->noteAnswerTeacher(reply.teacherFingerprint()); // each checkpoint names its teacher
  LossResult r;
  try {
    TeacherOutput teacher = reply.output();
    if (IdsAnswer* a = teacher.ids(); a && p.mb.samplingLogProbs.defined()) a->samplingLogProbs = p.mb.samplingLogProbs;
    const at::Tensor masked = session_.config.teacher.on_nonfinite == TeacherOnNonfinite::kMask
        ? train_impl::maskedTokens(teacher, p.mb.labels.numel())
        : at::Tensor();
    if (!masked.defined()) {
      r = loss(p.mb.labels, teacher);
    } else {
      r = train_impl::maskedLoss(loss, rows, p.mb.labels, teacher, masked, session_.config.loss, tokens_);
      masked_ += static_cast<double>(masked.sum().item<int64_t>());
    }
  } catch (const ProtocolError& e) {
    // The teacher's data did not fit (a vocabulary truncated of more than
    // loss.max_truncated_mass, indices out of range, ...): named by the
    // micro-batch it answers, not by the last one submitted (the error's default).
    DISTILL_THROW(ProtocolError, at(p.step, p.accStep), e.message());
  }
  massMax_ = std::max(massMax_, r.truncatedMassMax);
  massSum_ += std::max(0.0, r.truncatedMassSum);
  if (sync_) sync_->setSyncing(p.accStep + 1 == grad_acc_); // the step's last: its buckets go during backward
  const at::Tensor scaled = lossScale_.defined() ? r.loss * lossScale_ : r.loss;
  if (external_ && external_->trainerAverages) {
    (scaled * static_cast<double>(session_.student->worldSize())).backward(); // the trainer's average = the sum
  } else {
    scaled.backward();
  }
  reply.release();
  loss_ += r.loss.item<double>();
  // A term of weight 0 is not computed (LossResult: NaN): reported as 0, never NaN.
  if (session_.config.loss.alpha < 1) ce_ += r.ce.item<double>();
  if (session_.config.loss.alpha > 0) kd_ += r.kd.item<double>();
  if (p.accStep + 1 == grad_acc_) {
    syncGradients();
    checkFinite(p.step, p.accStep);
  }
  return r;
}

// loss.on_nonfinite, after the step's last backward and its gradient sum: a
// loss or gradient that is not finite stops the job (error) or leaves no
// gradient for the optimizer on every student (skip_step: agreed in one
// all-reduce, since a student's loss may be NaN where the summed gradient is not).
void Steps::Impl::checkFinite(int64_t step, int64_t accStep) {
  const bool lossBad = !std::isfinite(loss_);
  // With a loss scale, an overflowing gradient is the scaler's to skip.
  const bool gradBad = !lossScale_.defined() && !train_impl::gradientsFinite(params_);
  const int me = session_.student->group().rank();
  if (session_.config.loss.on_nonfinite == LossOnNonfinite::kError) {
    DISTILL_CHECK_T(NumericError, !lossBad && !gradBad, at(step, accStep), "step ", step, ": student rank ", me,
                    lossBad ? " computed a loss that is not finite (loss " + std::to_string(loss_) + ": kd " +
                            std::to_string(kd_) + ", ce " + std::to_string(ce_) + ", summed over its micro-batches)"
                            : std::string(" holds a summed gradient that is not finite (NaN or infinity)"),
                    "; the update must not be applied: lower the learning rate, look for a float16 overflow or bad "
                    "data, or set loss.on_nonfinite: skip_step to skip such steps on every student");
    return;
  }
  at::Tensor flag = at::tensor({lossBad || gradBad ? 1.0 : 0.0}, at::kDouble);
  session_.student->group().allReduce(flag, ReduceOp::kSum, "non-finite loss check (loss.on_nonfinite)");
  const int bad = static_cast<int>(flag.item<double>());
  if (bad == 0) return;
  skip_ = true;
  ++skipped_;
  train_impl::dropGradients(params_, lossScale_.defined());
  if (me == 0) {
    DISTILL_LOG(kWarning) << "step " << step << ": the loss or gradient is not finite on " << bad << " of "
                          << session_.student->worldSize()
                          << " student(s) (this one: " << (lossBad ? "loss" : gradBad ? "gradient" : "finite")
                          << "); no student applies this step's update (loss.on_nonfinite: skip_step; " << skipped_
                          << " step(s) skipped so far)";
  }
}

bool Steps::Impl::stepEnds() const { return stepOpen_ && !current_ && accStep_ + 1 == grad_acc_; }

// The one place the students' gradients are summed: the overlapped buckets
// awaited, or one all-reduce after backward.
void Steps::Impl::syncGradients() {
  if (external_ && external_->trainerAverages) return; // the trainer's DDP did it during backward
  if (sync_) {
    sync_->wait();
    sync_->setSyncing(false); // a backward of the trainer's own starts no collective
    return;
  }
  allReduceGradients(session_.student->group(), params_, session_.config.student.bucket_mb);
}

// After the optimizer step: the loss parts and the stop flag in one
// all-reduce, the status, the trainer's callback, the checkpoint.
void Steps::Impl::finishStep() {
  stepOpen_ = false;
  accStep_ = -1;
  const bool stopAsked = session_.client->stopRequested();
  at::Tensor t = at::tensor({loss_, ce_, kd_, stopAsked ? 1.0 : 0.0, massSum_, masked_}, at::kDouble);
  session_.student->group().allReduce(t, ReduceOp::kSum, "step losses and stop flag");
  StepReport& rep = last_;
  rep = StepReport{};
  rep.step = step_;
  rep.loss = t[0].item<double>(), rep.ce = t[1].item<double>(), rep.kd = t[2].item<double>();
  rep.stop = t[3].item<double>() > 0;
  rep.maskedTokens = static_cast<int64_t>(t[5].item<double>());
  rep.skipped = skip_;
  rep.skippedSteps = skipped_;
  maskedTotal_ += static_cast<double>(rep.maskedTokens);
  rep.tokens = tokens_;
  rep.seconds = static_cast<double>(monotonicNs() - stepStartNs_) * 1e-9;
  const double mine = rep.seconds > 0 ? myTokens_ / rep.seconds : 0;
  rep.tokensPerS = mine * session_.student->worldSize();
  rep.teacherWaitShare = rep.seconds > 0 ? std::min(1.0, wait_ / rep.seconds) : 0;
  StudentStatus status;
  status.step = step_, status.loss = rep.loss;
  if (session_.config.loss.alpha > 0) status.kd = rep.kd; // a term not computed is left unset: not shown
  if (session_.config.loss.alpha < 1) status.ce = rep.ce;
  status.tokens_per_s = mine, status.teacher_wait_share = rep.teacherWaitShare;
  if (session_.config.teacher.on_nonfinite == TeacherOnNonfinite::kMask) status.masked_tokens = maskedTotal_;
  if (session_.config.loss.on_nonfinite == LossOnNonfinite::kSkipStep) status.skipped_steps = double(skipped_);
  if (session_.config.loss.vocab == LossVocab::kTruncate) { // the same on every student: collective
    at::Tensor mx = at::tensor({massMax_}, at::kDouble);
    session_.student->group().allReduce(mx, ReduceOp::kMax, "step truncated teacher mass");
    rep.truncatedMassMax = mx.item<double>();
    rep.truncatedMassMean = tokens_ > 0 ? t[4].item<double>() / tokens_ : 0;
    status.truncated_mass = massMax_;
  }
  if (options_.onStatus) options_.onStatus(status);
  session_.client->publishStatus(status);
  if (options_.onStep) options_.onStep(rep);
  const int64_t bound = session_.config.run.steps;
  const bool last = bound > 0 && step_ >= bound;
  if (ckpt_->enabled() && (last || rep.stop || ckpt_->due(step_))) save(step_);
  if (rep.stop && !last) stopped_ = true;
  if (last || rep.stop) end();
}

bool Steps::Impl::save(int64_t step) {
  TrainState state; // collective; with checkpoint.async it returns at once
  state.step = step;
  state.data.index = step;
  if (options_.checkpointExtra) state.extra = options_.checkpointExtra();
  RankState rank;
  if (options_.checkpointRankExtra && ckpt_->enabled()) rank.extra = options_.checkpointRankExtra(step);
  savedStep_ = step;
  if (model_) {
    saveOk_ = ckpt_->save(step, *model_, *optimizer_, state, rank);
  } else if (ckpt_->enabled()) {
    auto [modelBytes, optimizerBytes] = external_->saveState();
    saveOk_ = ckpt_->saveBytes(step, std::move(modelBytes), std::move(optimizerBytes), state, rank, external_->cuda);
  } else {
    saveOk_ = false;
  }
  saveError_ = ckpt_->lastError();
  if (options_.onCheckpoint) options_.onCheckpoint(CheckpointReport{step, saveOk_, saveError_});
  return saveOk_;
}

// Training is over: the last step saved (once), every save published, the
// teacher told. Checkpoints off: nothing saved, nothing awaited.
void Steps::Impl::end() {
  if (ckpt_->enabled()) {
    if (step_ > savedStep_) save(step_);
    if (!ckpt_->wait()) { // an async save failed after save() handed it over
      saveOk_ = false;
      saveError_ = ckpt_->lastError();
      if (options_.onCheckpoint) options_.onCheckpoint(CheckpointReport{savedStep_, false, saveError_});
    }
  }
  session_.client->finish();
  done_ = true;
}

Steps::Steps(Session& session, torch::nn::Module& model, torch::optim::Optimizer& optimizer, StepsOptions options)
    : impl_(std::make_unique<Impl>(session, model, optimizer, std::move(options))) {}
Steps::Steps(Session& session, ExternalModel model, StepsOptions options)
    : impl_(std::make_unique<Impl>(session, std::move(model), std::move(options))) {}
Steps::~Steps() = default;

std::optional<StepItem> Steps::next(const Loader& loader) { return impl_->next(loader); }
void Steps::finish() { impl_->finish(); }
LossResult Steps::backward(const at::Tensor& logits) { return impl_->backward(logits); }
LossResult Steps::backward(const at::Tensor& hidden, const OutputHead& head) { return impl_->backward(hidden, head); }
void Steps::setLossScale(at::Tensor scale) { impl_->lossScale_ = std::move(scale); }
bool Steps::stepEnds() const { return impl_->stepEnds(); }
int64_t Steps::resumedStep() const { return impl_->resumed_; }
const std::string& Steps::resumedExtra() const { return impl_->resumedExtra_; }
const std::string& Steps::resumedRankExtra() const { return impl_->resumedRankExtra_; }
int64_t Steps::step() const { return impl_->step_; }
double Steps::stepTokens() const { return impl_->tokens_; }
bool Steps::stopped() const { return impl_->stopped_; }
bool Steps::saved() const { return impl_->saveOk_; }
const std::string& Steps::saveError() const { return impl_->saveError_; }
const StepReport& Steps::last() const { return impl_->last_; }
CheckpointManager& Steps::checkpoints() { return *impl_->ckpt_; }

} // namespace distill
