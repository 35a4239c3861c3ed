// The demo's single-process phases (alone.h): one LibTorch loop for the
// teacher and for the label-only student, which rebuilds the global batch of
// every step of the distilled students so that both train on the same tokens.
#include "alone.h"

#include <signal.h>

#include <distill/distill.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <optional>

#include "data.h"
#include "demo_run.h"
#include "gpt.h"

namespace distill::examples {
namespace {

using SteadyClock = std::chrono::steady_clock;

// SIGINT/SIGTERM: finish the step, checkpoint, leave.
volatile sig_atomic_t gStop = 0;
void onStopSignal(int sig) { gStop = sig; }

// The checkpoint of a single-process phase: one torch::serialize archive,
// replaced atomically. distill's CheckpointManager is collective on a student
// group, which a process training alone does not have.
struct AloneCheckpoint {
  std::string path;

  void save(torch::nn::Module& model, torch::optim::Optimizer& opt, int64_t step, const std::string& note) const {
    torch::serialize::OutputArchive archive, modelArchive, optArchive;
    model.save(modelArchive);
    opt.save(optArchive);
    archive.write("model", modelArchive);
    archive.write("optimizer", optArchive);
    archive.write("step", torch::tensor({static_cast<double>(step)}, torch::kDouble));
    archive.write("note", c10::IValue(note));
    archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());
    archive.save_to(path + ".tmp");
    publishFile(path + ".tmp", path);
  }
  // The step of the checkpoint (0: none) and its resume note.
  std::pair<int64_t, std::string> load(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                       const torch::Device& device) const {
    if (!fileExists(path)) return {0, ""};
    torch::serialize::InputArchive archive, modelArchive, optArchive;
    archive.load_from(path, device); // weights and optimizer state onto the model's device
    archive.read("model", modelArchive);
    archive.read("optimizer", optArchive);
    model.load(modelArchive);
    opt.load(optArchive);
    torch::Tensor step, rng;
    c10::IValue note;
    archive.read("step", step);
    archive.read("note", note);
    archive.read("rng", rng);
    at::Generator gen = at::detail::getDefaultCPUGenerator(); // a handle on the default generator
    gen.set_state(rng);
    return {static_cast<int64_t>(step[0].item<double>()), note.toStringRef()};
  }
};

void setLr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

double secondsSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

int trainAlone(PhaseKind kind, const Config& cfg) {
  const Settings s = Settings::fromConfig(cfg);
  const bool teacher = kind == PhaseKind::kTeacher;
  const GptOptions arch = teacher ? s.teacher : s.student;
  const int64_t steps = teacher ? s.teacherSteps : cfg.run.steps;
  DISTILL_CHECK_T(ConfigError, steps > 0, "run.steps must be > 0 for the demo's students");
  const int G = teacher ? 1 : cfg.student.grad_acc_steps;
  const int students = teacher ? 1 : studentWorld(cfg);
  const int64_t rows = teacher ? s.teacherBatch : s.batch;
  const double peakLr = teacher ? s.teacherLr : s.lr;
  TextData data(s.data, s.valFraction, arch.context);
  DemoRun run(cfg, kind, phaseKey(kind, cfg, s, data.path(), data.hash(), ""), steps, s.logEvery, true);
  torch::set_num_threads(s.threadsAlone > 0 ? s.threadsAlone : torch::get_num_threads());

  const bool weightsCurrent = !teacher ||
      (fileExists(s.teacherWeights) && run.phase().doneRecord()["weights"] == fileFingerprint(s.teacherWeights));
  if (run.finished(weightsCurrent)) return 0;
  const AloneCheckpoint ckpt{run.phase().path("checkpoint.pt")};
  run.prepare({ckpt.path});

  // The teacher trains on teacher.device, the label-only student on student.device.
  const torch::Device device(teacher ? teacherDevice(cfg.teacher, 0) : cfg.student.device);
  torch::manual_seed(cfg.run.seed); // the same initial weights in every phase
  Gpt model(arch);
  model->to(device);
  model->train();
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(peakLr).betas({0.9, 0.95}).weight_decay(s.weightDecay));
  const auto [start, note] = ckpt.load(*model, opt, device);
  run.resume(start, note);

  // The tokens of micro-batch `acc` of step `step`: the teacher's own stream;
  // for the label-only student, those of every distilled student.
  auto microBatch = [&](int64_t step, int acc) {
    if (teacher) {
      Batch b = data.sample(cfg.run.seed + 1, step, 0, acc, s.teacherBatch);
      return Batch{b.ids.to(device), b.labels.to(device)};
    }
    std::vector<at::Tensor> ids, labels;
    for (int r = 0; r < students; ++r) {
      Batch b = data.sample(cfg.run.seed, step, r, acc, s.batch);
      ids.push_back(b.ids);
      labels.push_back(b.labels);
    }
    return Batch{torch::cat(ids).to(device), torch::cat(labels).to(device)};
  };
  Batch val = data.validation(s.evalTokens);
  val = Batch{val.ids.to(device), val.labels.to(device)};
  run.line("[" + run.name() + "] " + arch.describe() + ", " + std::to_string(steps) + " steps of " +
           std::to_string(students * G * rows * arch.context) + " tokens, data " + data.path() + " (" +
           std::to_string(data.trainBytes()) + " train / " + std::to_string(data.valBytes()) + " validation bytes)");
  if (start == 0) run.validated(0, evaluate(model, val.ids, val.labels));
  ::signal(SIGINT, onStopSignal);
  ::signal(SIGTERM, onStopSignal);

  std::vector<at::Tensor> params = model->parameters();
  double lastVal = NAN;
  for (int64_t step = start + 1; step <= steps; ++step) {
    const auto stepStart = SteadyClock::now();
    StepRecord rec;
    rec.step = step;
    rec.lr = learningRate(peakLr, step, steps, s.warmup, s.minLrRatio);
    setLr(opt, rec.lr);
    std::vector<Batch> batches;
    double tokens = 0; // the loss is a sum over tokens divided by the step's tokens
    for (int acc = 0; acc < G; ++acc) {
      batches.push_back(microBatch(step, acc));
      tokens += static_cast<double>(batches.back().labels.numel());
    }
    for (const Batch& b : batches) {
      at::Tensor logits = model->forward(b.ids);
      auto ce = torch::nn::functional::cross_entropy(
                    logits.reshape({-1, logits.size(-1)}), b.labels.reshape({-1}),
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
          tokens;
      ce.backward();
      rec.loss += ce.item<double>();
    }
    rec.ce = rec.loss;
    if (s.gradClip > 0) torch::nn::utils::clip_grad_norm_(params, s.gradClip);
    opt.step();
    opt.zero_grad();

    const bool stop = gStop != 0;
    rec.seconds = secondsSince(stepStart);
    rec.tokensPerS = tokens / rec.seconds;
    run.trained(rec);
    if (step % s.evalEvery == 0 || step == steps) run.validated(step, lastVal = evaluate(model, val.ids, val.labels));
    if (step == steps || stop || (cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0)) {
      ckpt.save(*model, opt, step, run.resumeNote());
      run.checkpointed(step, true);
    }
    if (stop && step < steps) {
      run.stopped(step, true);
      return 128 + static_cast<int>(gStop);
    }
  }

  if (std::isnan(lastVal)) lastVal = evaluate(model, val.ids, val.labels); // resumed from the last step
  JsonLine extra;
  if (teacher) {
    const size_t slash = s.teacherWeights.rfind('/');
    if (slash != std::string::npos && slash > 0) makeDirs(s.teacherWeights.substr(0, slash));
    model->to(torch::kCPU); // the weights file holds CPU tensors: distill-teacher moves them to teacher.device
    saveGpt(model, s.teacherWeights);
    extra.add("weights", fileFingerprint(s.teacherWeights));
    run.line("[teacher] weights written to " + s.teacherWeights);
  }
  run.finish(lastVal, arch.parameterCount(), extra);
  return 0;
}

} // namespace

int trainTeacher(const Config& cfg) { return trainAlone(PhaseKind::kTeacher, cfg); }
int trainLabelOnly(const Config& cfg) { return trainAlone(PhaseKind::kLabelOnly, cfg); }

} // namespace distill::examples
