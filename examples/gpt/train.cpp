// distill-gpt: the demo's trainer, a small byte-level GPT trained with the
// LibTorch C++ frontend. trainStudent() below is the README's integration
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

#include <chrono>
#include <cmath>
#include <cstdio>

#include "alone.h"
#include "data.h"
#include "demo_run.h"
#include "gpt.h"
#include "report.h"

namespace ex = distill::examples;
using SteadyClock = std::chrono::steady_clock;

namespace {

// The file the teacher process serves: its fingerprint names the teacher in
// the checkpoints and in the phase's key.
std::string servedTeacher(const distill::Config& cfg, const ex::Settings& set) {
  if (cfg.teacher.kind == distill::TeacherKind::kSelf) return set.teacherWeights;
  return cfg.teacher.kind == distill::TeacherKind::kTorchscript ? cfg.teacher.path : cfg.teacher.weights;
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
  ex::DemoRun run(
      cfg, ex::PhaseKind::kDistilled,
      ex::phaseKey(ex::PhaseKind::kDistilled, cfg, set, data.path(), data.hash(),
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
  ex::Gpt model(set.student);
  model->train();
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(set.lr).betas({0.9, 0.95}).weight_decay(set.weightDecay));
  std::vector<at::Tensor> params = model->parameters();

  // distill: checkpoints are taken by the students only, collectively on their group.
  distill::CheckpointManager ckpt(*s.student, cfg.checkpoint, teacherPrint);
  int64_t start = 0;
  std::string note;
  if (auto loaded = ckpt.loadLatest(*model, opt)) start = loaded->train.step, note = loaded->train.extra;
  // distill: every student starts from student rank 0's parameters and buffers, as DDP does.
  distill::broadcastParameters(group, model->parameters(), model->buffers());
  run.resume(start, note);

  // distill: this student's shard of micro-batch `acc` of step `step`.
  auto shard = [&](int64_t step, int acc) { return data.sample(cfg.run.seed, step, group.rank(), acc, set.batch); };
  const ex::Batch val = data.validation(set.evalTokens);
  auto validate = [&] { // distill: evaluated on student rank 0 only, the value broadcast to all
    return distill::evaluateOnRank0(
        group, [&] { return std::vector<double>{ex::evaluate(model, val.ids, val.labels)}; }, 1)[0];
  };
  const int students = ex::studentWorld(cfg);
  run.line("[" + run.name() + "] " + set.student.describe() + ", " + std::to_string(steps) + " steps of " +
           std::to_string(students * G * set.batch * set.student.context) + " tokens, data " + data.path() + " (" +
           std::to_string(data.trainBytes()) + " train / " + std::to_string(data.valBytes()) + " validation bytes)");
  if (start == 0) run.validated(0, validate());

  // distill: one micro-batch in flight ahead: the teacher computes k+1 while this student computes k.
  distill::Handle inFlight = s.client->submit(shard(start + 1, 0).ids, start + 1, 0);
  double lastVal = NAN;
  for (int64_t step = start + 1; step <= steps; ++step) {
    const auto stepStart = SteadyClock::now();
    const double waitedBefore = s.client->teacherWaitSeconds();
    ex::StepRecord rec;
    rec.step = step;
    rec.hasKd = true;
    rec.lr = ex::learningRate(set.lr, step, steps, set.warmup, set.minLrRatio);
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(rec.lr);
    std::vector<ex::Batch> batches;
    std::vector<at::Tensor> labels;
    for (int acc = 0; acc < G; ++acc) {
      batches.push_back(shard(step, acc));
      labels.push_back(batches.back().labels);
    }
    // The loss is a sum over tokens divided by the step's tokens, over all micro-batches
    const double tokens = distill::stepTokenCount(group, labels, cfg.loss.ignore_index); // distill: and students
    for (int acc = 0; acc < G; ++acc) {
      const ex::Batch& b = batches[acc];
      at::Tensor logits = model->forward(b.ids);
      // distill: queue the next micro-batch, take the teacher's answer for this one, mix the losses.
      const distill::Handle handle = inFlight;
      if (acc + 1 < G)
        inFlight = s.client->submit(shard(step, acc + 1).ids, step, acc + 1);
      else if (step < steps)
        inFlight = s.client->submit(shard(step + 1, 0).ids, step + 1, 0);
      // distill: zero copy: the teacher's logits are read in place in the ring slot, freed with `reply`.
      distill::TeacherReply reply = s.client->get(handle, distill::ReplyMode::kView);
      distill::LossResult r = distill::distillLoss(logits, b.labels, reply.output(), cfg.loss, tokens);
      r.loss.backward();
      rec.loss += r.loss.item<double>();
      rec.ce += r.ce.item<double>();
      rec.kd += r.kd.item<double>();
    }
    distill::allReduceGradients(group, params, cfg.student.bucket_mb); // distill: sum the students' gradients
    if (set.gradClip > 0) torch::nn::utils::clip_grad_norm_(params, set.gradClip);
    opt.step();
    opt.zero_grad();

    // distill: the launcher's stop request, decided together (one all-reduce
    // that also sums the students' loss shares): every student leaves after the same step.
    auto stats = torch::tensor({rec.loss, rec.ce, rec.kd, s.client->stopRequested() ? 1.0 : 0.0}, torch::kDouble);
    group.allReduce(stats, distill::ReduceOp::kSum, "demo: step stats and stop flag");
    rec.loss = stats[0].item<double>(), rec.ce = stats[1].item<double>(), rec.kd = stats[2].item<double>();
    const bool stop = stats[3].item<double>() > 0;
    rec.seconds = std::chrono::duration<double>(SteadyClock::now() - stepStart).count();
    const double myTokensPerS = static_cast<double>(G * labels[0].numel()) / rec.seconds;
    rec.tokensPerS = myTokensPerS * students;
    rec.teacherWaitShare = std::min(1.0, (s.client->teacherWaitSeconds() - waitedBefore) / rec.seconds);
    distill::StudentStatus status; // distill: distill-run's live line and summary
    status.step = step, status.loss = rec.loss, status.kd = rec.kd, status.ce = rec.ce,
    status.tokens_per_s = myTokensPerS;
    s.client->publishStatus(status);
    run.trained(rec);
    if (step % set.evalEvery == 0 || step == steps) run.validated(step, lastVal = validate());

    bool saved = false;
    if (step == steps || stop || ckpt.due(step)) {
      distill::TrainState state; // distill: collective; with checkpoint.async it returns at once
      state.step = step;
      state.data.index = step;
      state.extra = run.resumeNote();
      saved = ckpt.save(step, *model, opt, state); // false: a save failed and checkpoint.on_error=continue
      run.checkpointed(step, saved);
    }
    if (stop && step < steps) {
      run.stopped(step, saved);
      s.client->finish(); // distill
      return 0;
    }
  }

  if (std::isnan(lastVal)) lastVal = validate(); // resumed from the last step's checkpoint
  run.finish(lastVal, set.student.parameterCount());
  s.client->finish(); // distill: this student is done
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
