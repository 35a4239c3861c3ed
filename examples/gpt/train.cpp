// distill-gpt: the demo's trainer. A small byte-level GPT trained with the
// LibTorch C++ frontend — an "existing trainer" — and the same trainer with
// distill added. The lines marked `distill:` in train() are everything the
// distillation mode adds to the label-only one (README, "Integrating distill").
//
//   distill-gpt train-teacher --config configs/demo.yaml   the teacher (alone; skipped when done)
//   distill-gpt label-only    --config configs/demo.yaml   the student on labels only (alone)
//   distill-run --config configs/demo.yaml -- distill-gpt distill
//                                                          the students, taught by the teacher
//   distill-gpt report        --config configs/demo.yaml   plot, table, summary.json
//
// Every mode takes --set section.key=value. examples/gpt/demo.sh runs them in
// order; each resumes from its checkpoint and a finished one is skipped.
#include <signal.h>
#include <unistd.h>

#include <distill/distill.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <sstream>

#include "data.h"
#include "demo_support.h"
#include "gpt.h"
#include "report.h"

namespace ex = distill::examples;
using SteadyClock = std::chrono::steady_clock;

namespace {

enum class Mode { kTeacher, kLabelOnly, kDistill };

// SIGINT/SIGTERM in a single-process phase: finish the step, checkpoint, leave.
// (Under distill-run the launcher turns them into Client::stopRequested().)
volatile sig_atomic_t gStop = 0;
void onStopSignal(int sig) { gStop = sig; }

double secondsSince(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

// The phase key: every setting its result depends on, except the number of
// steps (a run may be extended and resumes).
std::string phaseKey(Mode mode, const distill::Config& cfg, const ex::Settings& s, const ex::TextData& data) {
  std::ostringstream k;
  k << "data=" << data.path() << "#" << std::hex << data.hash() << std::dec << " val=" << s.valFraction
    << " seed=" << cfg.run.seed << " clip=" << s.gradClip << " wd=" << s.weightDecay << " warmup=" << s.warmup
    << " min_lr=" << s.minLrRatio;
  if (mode == Mode::kTeacher) {
    k << " teacher=" << s.teacher.describe() << " dropout=" << s.teacher.dropout << " steps=" << s.teacherSteps
      << " batch=" << s.teacherBatch << " lr=" << s.teacherLr;
    return k.str();
  }
  k << " student=" << s.student.describe() << " batch=" << s.batch << "x" << ex::studentWorld(cfg) << "x"
    << cfg.student.grad_acc_steps << " lr=" << s.lr << " eval=" << s.evalEvery << "/" << s.evalTokens;
  if (mode == Mode::kDistill) {
    const std::string served = cfg.teacher.kind == distill::TeacherKind::kTorchscript ? cfg.teacher.path : cfg.teacher.weights;
    k << " loss=" << cfg.loss.kind << " T=" << cfg.loss.temperature << " alpha=" << cfg.loss.alpha
      << " beta=" << cfg.loss.jsd_beta << " topk=" << cfg.teacher.topk << " teacher=" << cfg.teacher.kind << ":"
      << (cfg.teacher.kind == distill::TeacherKind::kSelf ? s.teacherWeights : served) << "@"
      << distill::fileFingerprint(cfg.teacher.kind == distill::TeacherKind::kSelf ? s.teacherWeights : served);
  }
  return k.str();
}

// The label-only trainer's own checkpoint: one file, replaced atomically.
struct OwnCheckpoint {
  std::string path;

  void save(torch::nn::Module& model, torch::optim::Optimizer& opt, int64_t step, int64_t launch,
            double elapsed) const {
    torch::serialize::OutputArchive archive, modelArchive, optArchive;
    model.save(modelArchive);
    opt.save(optArchive);
    archive.write("model", modelArchive);
    archive.write("optimizer", optArchive);
    archive.write("state", torch::tensor({static_cast<double>(step), static_cast<double>(launch), elapsed},
                                         torch::kDouble));
    archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());
    archive.save_to(path + ".tmp");
    ex::publishFile(path + ".tmp", path);
  }
  // Returns (step, launch, elapsed) of the checkpoint, or nullopt if none.
  std::optional<std::tuple<int64_t, int64_t, double>> load(torch::nn::Module& model,
                                                           torch::optim::Optimizer& opt) const {
    if (!ex::fileExists(path)) return std::nullopt;
    torch::serialize::InputArchive archive, modelArchive, optArchive;
    archive.load_from(path);
    archive.read("model", modelArchive);
    archive.read("optimizer", optArchive);
    model.load(modelArchive);
    opt.load(optArchive);
    torch::Tensor state, rng;
    archive.read("state", state);
    archive.read("rng", rng);
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle on the default generator
    gen.set_state(rng);
    return std::make_tuple(static_cast<int64_t>(state[0].item<double>()),
                           static_cast<int64_t>(state[1].item<double>()), state[2].item<double>());
  }
};

// One live progress line on a terminal; otherwise a line every `every` steps.
class Progress {
 public:
  Progress(std::string phase, int64_t steps, int64_t every, bool quiet)
      : phase_(std::move(phase)), steps_(steps), every_(every), quiet_(quiet), tty_(::isatty(1) == 1) {}
  // `loss`: what is minimised; `ce`, `kd`: its parts when distilling (NaN: none).
  void step(int64_t step, double loss, double ce, double kd, double tokensPerS) {
    if (quiet_) return;
    char buf[240];
    int n = std::snprintf(buf, sizeof buf, "[%s] step %lld/%lld  loss %.4f", phase_.c_str(),
                          static_cast<long long>(step), static_cast<long long>(steps_), loss);
    if (!std::isnan(kd)) n += std::snprintf(buf + n, sizeof buf - n, " (ce %.4f, kd %.4f)", ce, kd);
    std::snprintf(buf + n, sizeof buf - n, "  tokens/s %.0f", tokensPerS);
    if (tty_) {
      std::printf("\r\033[K%s", buf);
      std::fflush(stdout);
      live_ = true;
    } else if (step % every_ == 0 || step == steps_) {
      std::printf("%s\n", buf);
    }
  }
  void line(const std::string& text) {
    if (quiet_) return;
    if (live_) std::printf("\r\033[K");
    live_ = false;
    std::printf("%s\n", text.c_str());
  }

 private:
  std::string phase_;
  int64_t steps_, every_;
  bool quiet_, tty_, live_ = false;
};

void setLr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

// The training loop of every mode. Without `session` it is an ordinary
// single-process LibTorch trainer (label-only student, or the teacher); with
// one, the lines marked `distill:` make it a student of a distill job.
int train(Mode mode, const distill::Config& cfg, distill::Session* session) {
  const ex::Settings s = ex::Settings::fromConfig(cfg);
  const bool teacher = mode == Mode::kTeacher;
  const ex::GptOptions arch = teacher ? s.teacher : s.student;
  const int64_t steps = teacher ? s.teacherSteps : cfg.run.steps;
  DISTILL_CHECK_T(ConfigError, steps > 0, "run.steps must be > 0 for the demo's students");
  const int G = teacher ? 1 : cfg.student.grad_acc_steps;
  const double peakLr = teacher ? s.teacherLr : s.lr;
  ex::TextData data(s.data, s.valFraction, arch.context);
  ex::Phase phase(cfg.run.log_dir, teacher ? "teacher" : session ? "distilled" : "label_only",
                  phaseKey(mode, cfg, s, data));

  // distill: this student's rank in the student group (the teacher is in none).
  distill::StudentGroup* group = session ? &session->student->group() : nullptr;
  const int rank = group ? group->rank() : 0;
  const bool rank0 = rank == 0;
  torch::set_num_threads(session ? std::max(1, s.threads)
                                 : s.threadsAlone > 0 ? s.threadsAlone : torch::get_num_threads());

  if (teacher ? phase.done(steps) && ex::fileExists(s.teacherWeights) &&
                    phase.doneRecord()["weights"] == distill::fileFingerprint(s.teacherWeights)
              : phase.done(steps)) {
    if (rank0) std::printf("[%s] already finished (%s/done.json): skipped\n", phase.name().c_str(), phase.dir().c_str());
    if (session) session->client->finish();  // distill: tell the teacher this student is done
    return 0;
  }
  // Checkpoints of other settings are not resumed: the phase starts afresh.
  const std::string ownCkpt = phase.path("checkpoint.pt");
  if (rank0) {
    std::vector<std::string> old = {ownCkpt};
    if (session && !cfg.checkpoint.dir.empty()) old.push_back(cfg.checkpoint.dir);
    if (phase.stale()) {
      std::printf("[%s] settings changed since its checkpoints were written: starting afresh\n", phase.name().c_str());
      phase.reset(old);
    }
    phase.writeKey();
  }
  if (group) group->barrier("demo: phase folder ready");  // distill: the others wait for rank 0's reset

  // The same initial weights in every mode and on every student.
  torch::manual_seed(cfg.run.seed);
  ex::Gpt model(arch);
  model->train();
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(peakLr).betas({0.9, 0.95}).weight_decay(s.weightDecay));

  // Resume.
  int64_t start = 0, launch = 1;
  double elapsedBefore = 0;
  OwnCheckpoint own{ownCkpt};
  std::unique_ptr<distill::CheckpointManager> ckpt;
  if (session) {
    // distill: checkpoints taken by the students only, on their group.
    const std::string served = cfg.teacher.kind == distill::TeacherKind::kTorchscript ? cfg.teacher.path : cfg.teacher.weights;
    ckpt = std::make_unique<distill::CheckpointManager>(*session->student, cfg.checkpoint,
                                                        distill::fileFingerprint(served));
    if (auto loaded = ckpt->loadLatest(*model, opt)) {
      start = loaded->train.step;
      long long launches = 1;
      std::sscanf(loaded->train.extra.c_str(), "launch=%lld elapsed=%lf", &launches, &elapsedBefore);
      launch = launches + 1;
    }
  } else if (auto loaded = own.load(*model, opt)) {
    std::tie(start, launch, elapsedBefore) = *loaded;
    ++launch;
  }
  if (start > 0 && rank0) std::printf("[%s] resumed from step %lld (launch %lld)\n", phase.name().c_str(),
                                      static_cast<long long>(start), static_cast<long long>(launch));
  if (rank0) phase.openMetrics(start);

  // Tokens of one micro-batch of step `step`: this student's share under
  // distill; the whole step of every student when alone (label-only), so both
  // modes train on the same tokens.
  const int students = teacher ? 1 : ex::studentWorld(cfg);
  auto microBatch = [&](int64_t step, int acc) {
    if (teacher) return data.sample(cfg.run.seed + 1, step, 0, acc, s.teacherBatch);
    if (session) return data.sample(cfg.run.seed, step, rank, acc, s.batch);  // distill: shard by rank
    std::vector<at::Tensor> ids, labels;
    for (int r = 0; r < students; ++r) {
      ex::Batch b = data.sample(cfg.run.seed, step, r, acc, s.batch);
      ids.push_back(b.ids);
      labels.push_back(b.labels);
    }
    return ex::Batch{torch::cat(ids), torch::cat(labels)};
  };
  const ex::Batch val = data.validation(s.evalTokens);
  auto validate = [&] {
    if (!group) return ex::evaluate(model, val.ids, val.labels);
    // distill: evaluated on student rank 0 only, the value broadcast to all.
    return distill::evaluateOnRank0(*group, [&] { return std::vector<double>{ex::evaluate(model, val.ids, val.labels)}; }, 1)[0];
  };

  Progress progress(phase.name(), steps, s.logEvery, !rank0);
  progress.line("[" + phase.name() + "] " + arch.describe() + ", " + std::to_string(steps) + " steps of " +
                std::to_string(students * G * (teacher ? s.teacherBatch : s.batch) * arch.context) +
                " tokens, data " + data.path() + " (" + std::to_string(data.trainBytes()) + " train / " +
                std::to_string(data.valBytes()) + " validation bytes)");
  if (start == 0) {
    const double v = validate();
    if (rank0) phase.record(ex::JsonLine().add("phase", phase.name()).add("launch", launch).add("step", 0).add("val_loss", v));
  }
  if (!session) {
    ::signal(SIGINT, onStopSignal);
    ::signal(SIGTERM, onStopSignal);
  }

  std::vector<at::Tensor> params = model->parameters();
  const auto t0 = SteadyClock::now();
  double lastVal = NAN;
  // distill: the teacher works on the next micro-batch while this one is computed.
  std::optional<distill::Handle> inFlight;
  std::optional<ex::Batch> nextBatch;
  auto submitNext = [&](int64_t step, int acc) {
    if (!session || step > steps) return;
    nextBatch = microBatch(step, acc);
    inFlight = session->client->submit(nextBatch->ids, step, acc);
  };
  submitNext(start + 1, 0);

  for (int64_t step = start + 1; step <= steps; ++step) {
    const auto stepStart = SteadyClock::now();
    const double lr = ex::learningRate(peakLr, step, steps, s.warmup, s.minLrRatio);
    setLr(opt, lr);
    std::vector<ex::Batch> batches;
    std::vector<at::Tensor> labels;
    for (int acc = 0; acc < G; ++acc) {
      batches.push_back(session && acc == 0 && nextBatch ? *nextBatch : microBatch(step, acc));
      labels.push_back(batches.back().labels);
    }
    // Loss = sum over tokens / tokens of the whole step (all micro-batches, all students).
    double tokens = 0;
    if (group) {
      tokens = distill::stepTokenCount(*group, labels, cfg.loss.ignore_index);  // distill
    } else {
      for (auto& l : labels) tokens += static_cast<double>(l.numel());
    }
    double lossSum = 0, ceSum = 0, kdSum = 0;
    for (int acc = 0; acc < G; ++acc) {
      const ex::Batch& b = batches[acc];
      at::Tensor logits = model->forward(b.ids);
      if (session) {
        // distill: queue the next micro-batch, take the teacher's answer for this one, mix the losses.
        const distill::Handle handle = *inFlight;
        if (acc + 1 < G) submitNext(step, acc + 1);
        else submitNext(step + 1, 0);
        // Zero copy: the teacher's logits are read in place in the ring slot, freed with `reply`.
        distill::TeacherReply reply = session->client->get(handle, distill::ReplyMode::kView);
        distill::LossResult r = distill::distillLoss(logits, b.labels, reply.output(), cfg.loss, tokens);
        r.loss.backward();
        lossSum += r.loss.item<double>();
        ceSum += r.ce.item<double>();
        kdSum += r.kd.item<double>();
      } else {
        auto ce = torch::nn::functional::cross_entropy(
                      logits.reshape({-1, logits.size(-1)}), b.labels.reshape({-1}),
                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                  tokens;
        ce.backward();
        lossSum += ce.item<double>();
        ceSum += ce.item<double>();
      }
    }
    // distill: sum the students' gradients (each already divided by the step's tokens).
    if (group) distill::allReduceGradients(*group, params, cfg.student.bucket_mb);
    if (s.gradClip > 0) torch::nn::utils::clip_grad_norm_(params, s.gradClip);
    opt.step();
    opt.zero_grad();

    // Stop? Alone: a signal. distill: the launcher's stop request, decided
    // together (one all-reduce that also sums the students' loss shares) so
    // that every student leaves after the same step.
    bool stop = gStop != 0;
    if (group) {
      auto stats = torch::tensor({lossSum, ceSum, kdSum, session->client->stopRequested() ? 1.0 : 0.0}, torch::kDouble);
      group->allReduce(stats, distill::ReduceOp::kSum, "demo: step stats and stop flag");
      lossSum = stats[0].item<double>(), ceSum = stats[1].item<double>(), kdSum = stats[2].item<double>();
      stop = stats[3].item<double>() > 0;
    }
    const double stepS = secondsSince(stepStart);
    const double myTokensPerS = static_cast<double>(labels.size() * labels[0].numel()) / stepS;
    if (session) {
      std::printf("DISTILL_STATUS step=%lld loss=%.4f tokens_per_s=%.0f\n", static_cast<long long>(step), lossSum,
                  myTokensPerS);  // distill-run's live line
    }
    progress.step(step, lossSum, ceSum, session ? kdSum : NAN, myTokensPerS * (session ? students : 1));
    if (rank0) {
      ex::JsonLine rec;
      rec.add("phase", phase.name()).add("launch", launch).add("step", step).add("loss", lossSum).add("ce", ceSum);
      if (session) rec.add("kd", kdSum);
      rec.add("lr", lr).add("step_ms", 1000 * stepS).add("tokens_per_s", myTokensPerS * (session ? students : 1))
          .add("elapsed_s", elapsedBefore + secondsSince(t0));
      phase.record(rec);
    }
    if (step % s.evalEvery == 0 || step == steps) {
      lastVal = validate();
      if (rank0) {
        phase.record(ex::JsonLine().add("phase", phase.name()).add("launch", launch).add("step", step).add("val_loss", lastVal));
        char buf[160];
        std::snprintf(buf, sizeof buf, "[%s] step %lld/%lld  validation loss %.4f nats/byte", phase.name().c_str(),
                      static_cast<long long>(step), static_cast<long long>(steps), lastVal);
        progress.line(buf);
      }
    }
    const double elapsed = elapsedBefore + secondsSince(t0);
    const bool due = step == steps || stop ||
                     (cfg.checkpoint.every_steps > 0 && step % cfg.checkpoint.every_steps == 0);
    bool saved = false;
    if (due) {
      if (ckpt) {
        // distill: collective on the student group; the teacher takes no part.
        // With checkpoint.async it returns at once; the CheckpointManager
        // publishes it (and its destructor waits for that) in the background.
        distill::TrainState state;
        state.step = step;
        state.data.index = step;
        state.extra = "launch=" + std::to_string(launch) + " elapsed=" + std::to_string(elapsed);
        // false: a save failed (this one; async: the previous one) and checkpoint.on_error=continue
        saved = ckpt->save(step, *model, opt, state);
      } else {
        own.save(*model, opt, step, launch, elapsed);
        saved = true;
      }
      if (rank0) {
        progress.line("[" + phase.name() + "] " +
                      (saved ? "checkpoint saved at step " + std::to_string(step)
                             : "checkpoint at step " + std::to_string(step) +
                                   ": a save failed (the log says which and why)"));
      }
    }
    if (stop && step < steps) {
      if (rank0) {
        progress.line("[" + phase.name() + "] stopped at step " + std::to_string(step) +
                      (saved ? " (checkpoint saved)" : " (a checkpoint failed: see the log)") +
                      ": run again to resume");
      }
      if (session) session->client->finish();  // distill
      return session ? 0 : 128 + static_cast<int>(gStop);
    }
  }

  if (std::isnan(lastVal)) lastVal = validate();  // resumed from the last step's checkpoint
  const double seconds = elapsedBefore + secondsSince(t0);
  if (rank0) {
    ex::JsonLine done;
    done.add("val_loss", lastVal).add("steps", steps).add("seconds", seconds)
        .add("parameters", arch.parameterCount());
    if (teacher) {
      const size_t slash = s.teacherWeights.rfind('/');
      if (slash != std::string::npos && slash > 0) ex::makeDirs(s.teacherWeights.substr(0, slash));
      ex::saveGpt(model, s.teacherWeights);
      done.add("weights", distill::fileFingerprint(s.teacherWeights));
      progress.line("[teacher] weights written to " + s.teacherWeights);
    }
    phase.markDone(done);
    char buf[200];
    std::snprintf(buf, sizeof buf, "[%s] finished: %lld steps in %.1f s, validation loss %.4f", phase.name().c_str(),
                  static_cast<long long>(steps), seconds, lastVal);
    progress.line(buf);
  }
  if (session) session->client->finish();  // distill: this student is done
  return 0;
}

// teacher.kind self: this binary serves the trained teacher in teacher role.
int serveSelf(distill::Session& session) {
  const ex::Settings s = ex::Settings::fromConfig(session.config);
  torch::set_num_threads(std::max(1, session.config.teacher.threads > 0 ? session.config.teacher.threads : s.threads));
  ex::Gpt model = ex::loadGpt(s.teacherWeights);
  distill::serve(*session.teacher, std::make_shared<distill::ModuleTeacher<ex::GptImpl>>(
                                       model.ptr(), session.config.teacher.output,
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

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // line by line, also into distill-run's pipe
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
      if (session.isTeacher()) return serveSelf(session);
      return train(Mode::kDistill, session.config, &session);
    }
    if (mode == "train-teacher" || mode == "label-only" || mode == "report") {
      distill::Config cfg = distill::jobConfig(argc, argv);
      if (mode == "report") return ex::report(cfg);
      return train(mode == "train-teacher" ? Mode::kTeacher : Mode::kLabelOnly, cfg, nullptr);
    }
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distill-gpt %s: %s\n", mode.c_str(), e.what());
    return 1;
  }
}
