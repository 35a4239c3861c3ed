// distill-gpt: the demo's trainer, a small byte-level GPT trained with the
// LibTorch C++ frontend. trainStudent() below is docs/cpp.md's integration
// loop: an ordinary data-parallel training loop in which the lines marked
// `distill:` are everything distillation adds. The label-only student and
// the teacher's own training (the same loop without distill) are in alone.cpp;
// the demo's bookkeeping (phases, resume, progress, metrics) in demo_run.h.
//
//   distill-gpt train-teacher --config configs/demo.yaml   the teacher (alone; skipped when done)
//   distill-gpt label-only    --config configs/demo.yaml   the student on labels only (alone)
//   distill-run --config configs/demo.yaml -- distill-gpt distill
//                                                          the students, taught by the teacher
//   distill-gpt report        --config configs/demo.yaml   plot, table, summary.json
//
// Every mode takes --set section.key=value. examples/gpt/demo.sh runs them in
// order; each resumes from its checkpoint and a finished one is skipped.
#include <distill/distill.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <optional>

#include "alone.h"
#include "data.h"
#include "demo_run.h"
#include "gpt.h"
#include "report.h"

namespace ex = distill::examples;

namespace {

// The file the teacher process serves: its fingerprint names the teacher in
// the checkpoints and in the phase's key.
std::string servedTeacher(const distill::Config& cfg, const ex::Settings& set) {
  if (cfg.teacher.kind == distill::TeacherKind::kSelf) return set.teacherWeights;
  return cfg.teacher.kind == distill::TeacherKind::kTorchscript ? cfg.teacher.path : cfg.teacher.weights;
}

void setLearningRate(torch::optim::AdamW& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

// One student of a distill job (run it under distill-run).
int trainStudent(distill::Session& s) {
  const distill::Config& cfg = s.config;
  const ex::Settings set = ex::Settings::fromConfig(cfg);
  const int64_t steps = cfg.run.steps;
  DISTILL_CHECK_T(ConfigError, steps > 0, "run.steps must be > 0 for the demo's students");
  const int G = cfg.student.grad_acc_steps;
  distill::StudentGroup& group = s.student->group(); // distill: the students' own group (no teacher in it)
  const std::string teacherFile = servedTeacher(cfg, set);
  const std::string teacherPrint = distill::fileFingerprint(teacherFile);
  ex::TextData data(set.data, set.valFraction, set.student.context);
  const ex::PhaseKind kind = set.phase == "distilled" ? ex::PhaseKind::kDistilled : ex::PhaseKind::kDistilledCached;
  ex::DemoRun run(
      cfg, kind,
      ex::phaseKey(kind, cfg, set, data.path(), data.hash(),
                   std::string(distill::toString(cfg.teacher.kind)) + ":" + teacherFile + "@" + teacherPrint),
      steps, set.logEvery, group.rank() == 0);
  torch::set_num_threads(std::max(1, set.threads));
  if (run.finished()) {
    s.client->finish(); // distill: tell the teacher this student is done
    return 0;
  }
  run.prepare(cfg.checkpoint.dir.empty() ? std::vector<std::string>{} : std::vector<std::string>{cfg.checkpoint.dir});
  group.barrier("demo: phase folder ready"); // distill: the others wait for rank 0's reset

  torch::manual_seed(cfg.run.seed); // the same initial weights on every student and in every phase
  const torch::Device device(cfg.student.device); // the student's model and micro-batches
  ex::Gpt model(set.student);
  model->to(device);
  model->train();
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(set.lr).betas({0.9, 0.95}).weight_decay(set.weightDecay));

  ex::Batch val = data.validation(set.evalTokens);
  val = ex::Batch{val.ids.to(device), val.labels.to(device)};
  auto validate = [&] { // distill: evaluated on student rank 0 only, the value broadcast to all
    return distill::evaluateOnRank0(
        group, [&] { return std::vector<double>{ex::evaluate(model, val.ids, val.labels)}; }, 1)[0];
  };
  double lastVal = NAN;
  distill::StepsOptions hooks; // distill: the demo's bookkeeping, called by the step API
  hooks.teacherFingerprint = teacherPrint;
  hooks.checkpointExtra = [&] { return run.resumeNote(); };
  hooks.onCheckpoint = [&](const distill::CheckpointReport& c) { run.checkpointed(c.step, c.saved, c.error); };
  hooks.onStep = [&](const distill::StepReport& r) {
    ex::StepRecord rec;
    rec.step = r.step, rec.hasKd = true, rec.lr = ex::learningRate(set.lr, r.step, steps, set.warmup, set.minLrRatio);
    rec.loss = r.loss, rec.ce = r.ce, rec.kd = r.kd, rec.seconds = r.seconds, rec.tokensPerS = r.tokensPerS;
    rec.teacherWaitShare = r.teacherWaitShare;
    run.trained(rec);
    if (r.step % set.evalEvery == 0 || r.step == steps) run.validated(r.step, lastVal = validate());
  };
  distill::Steps train(s, *model, opt, hooks); // distill: resumes from the latest checkpoint
  const int64_t start = train.resumedStep();
  run.resume(start, train.resumedExtra());

  const int students = ex::studentWorld(cfg);
  run.line("[" + run.name() + "] " + set.student.describe() + ", " + std::to_string(steps) + " steps of " +
           std::to_string(students * G * set.batch * set.student.context) + " tokens, data " + data.path() + " (" +
           std::to_string(data.trainBytes()) + " train / " + std::to_string(data.valBytes()) + " validation bytes)");
  if (start == 0) run.validated(0, validate());

  // This student's shard of each micro-batch, in order from the step after the checkpoint.
  int64_t step = start + 1, acc = 0;
  auto loader = [&]() -> std::optional<distill::MicroBatch> {
    ex::Batch b = data.sample(cfg.run.seed, step, group.rank(), acc, set.batch);
    if (++acc == G) acc = 0, ++step;
    return distill::MicroBatch{b.ids.to(device), b.labels.to(device)};
  };
  while (auto mb = train.next(loader)) { // distill: the teacher already has the next ones
    if (mb->accStep == 0) setLearningRate(opt, ex::learningRate(set.lr, mb->step, steps, set.warmup, set.minLrRatio));
    train.backward(model->forward(mb->inputs)); // distill: the teacher's answer, the loss, backward
    if (train.stepEnds()) { // distill: the students' gradients are summed by now
      if (set.gradClip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), set.gradClip);
      opt.step();
      opt.zero_grad();
    }
  }
  if (train.stopped()) { // a stop request (or a loader run dry): saved and published; the teacher told
    run.stopped(train.step(), train.saved(), train.saveError(), train.checkpoints().enabled());
    return 0;
  }
  if (std::isnan(lastVal)) lastVal = validate(); // resumed from the last step's checkpoint
  // The share of this student's rows its teacher answered from teacher.cache (0 with it off).
  run.finish(lastVal, set.student.parameterCount(),
             ex::JsonLine()
                 .add("teacher_cache_hit_share", s.client->teacherCacheHitShare())
                 .add("temperature", cfg.loss.temperature));
  return 0;
}

// teacher.kind self: this binary serves the trained teacher in teacher role.
int serveSelf(distill::Session& session) {
  const ex::Settings s = ex::Settings::fromConfig(session.config);
  torch::set_num_threads(std::max(1, session.config.teacher.threads > 0 ? session.config.teacher.threads : s.threads));
  ex::Gpt model = ex::loadGpt(s.teacherWeights);
  distill::serve(*session.teacher,
                 std::make_shared<distill::ModuleTeacher<ex::GptImpl>>(model.ptr(), session.config.teacher.output,
                                                                       distill::fileFingerprint(s.teacherWeights)));
  return 0;
}

int usage() {
  std::fprintf(stderr,
               "usage: distill-gpt MODE --config FILE [--set section.key=value]...\n"
               "  train-teacher  train the teacher alone (skipped when trainer.teacher_weights is up to date)\n"
               "  label-only     train the student on labels only, alone\n"
               "  distill        a student of a distill job: run it under distill-run\n"
               "  report         plot, table and summary.json of the finished phases\n");
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0); // line by line, also into distill-run's pipe
  std::string mode;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" || a == "--set") {
      ++i;
    } else if (a.rfind("--", 0) != 0) {
      mode = a;
      break;
    }
  }
  try {
    if (mode == "distill") {
      // distill: the trainer's keys and values are checked before any rank waits on another.
      distill::InitOptions checks(ex::Settings::keys());
      checks.validate = [](const distill::Config& c) { ex::Settings::fromConfig(c); };
      distill::Session session = distill::init(argc, argv, checks);
      return session.isTeacher() ? serveSelf(session) : trainStudent(session);
    }
    if (mode == "train-teacher") return ex::trainTeacher(distill::jobConfig(argc, argv));
    if (mode == "label-only") return ex::trainLabelOnly(distill::jobConfig(argc, argv));
    if (mode == "report") return ex::report(distill::jobConfig(argc, argv));
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distill-gpt %s: %s\n", mode.c_str(), e.what());
    return 1;
  }
}
