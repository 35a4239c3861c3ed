#include "demo_run.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <sstream>

namespace distill::examples {
namespace {

double monotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* phaseName(PhaseKind kind) {
  switch (kind) {
    case PhaseKind::kTeacher:
      return "teacher";
    case PhaseKind::kLabelOnly:
      return "label_only";
    case PhaseKind::kDistilled:
      return "distilled";
    case PhaseKind::kDistilledCached:
      return "distilled_cached";
  }
  return "?";
}

} // namespace

std::string phaseKey(PhaseKind kind, const Config& cfg, const Settings& s, const std::string& dataPath,
                     uint64_t dataHash, const std::string& teacherServed) {
  std::ostringstream k;
  k << "data=" << dataPath << "#" << std::hex << dataHash << std::dec << " val=" << s.valFraction
    << " seed=" << cfg.run.seed << " clip=" << s.gradClip << " wd=" << s.weightDecay << " warmup=" << s.warmup
    << " min_lr=" << s.minLrRatio;
  if (kind == PhaseKind::kTeacher) {
    k << " teacher=" << s.teacher.describe() << " dropout=" << s.teacher.dropout << " steps=" << s.teacherSteps
      << " batch=" << s.teacherBatch << " lr=" << s.teacherLr;
    return k.str();
  }
  k << " student=" << s.student.describe() << " batch=" << s.batch << "x" << studentWorld(cfg) << "x"
    << cfg.student.grad_acc_steps << " lr=" << s.lr << " eval=" << s.evalEvery << "/" << s.evalTokens;
  if (kind == PhaseKind::kDistilled || kind == PhaseKind::kDistilledCached) {
    k << " loss=" << cfg.loss.kind << " T=" << cfg.loss.temperature << " alpha=" << cfg.loss.alpha
      << " beta=" << cfg.loss.jsd_beta << " topk=" << cfg.teacher.topk << " teacher=" << teacherServed;
    // A run that wrote no cache is redone once the cache is asked for, so the cached phase finds it.
    if (cfg.teacher.cache.mode != CacheMode::kOff)
      k << " cache=" << toString(cfg.teacher.cache.mode) << ":" << cfg.teacher.cache.path;
  }
  return k.str();
}

DemoRun::DemoRun(const Config& cfg, PhaseKind kind, std::string key, int64_t steps, int64_t logEvery, bool rank0)
    : phase_(cfg.run.log_dir, phaseName(kind), std::move(key)),
      steps_(steps),
      logEvery_(logEvery),
      rank0_(rank0),
      tty_(::isatty(1) == 1),
      t0_(monotonicSeconds()) {}

bool DemoRun::finished(bool alsoDone) {
  if (!(phase_.done(steps_) && alsoDone)) return false;
  if (rank0_) {
    std::printf("[%s] already finished (%s/done.json): skipped\n", name().c_str(), phase_.dir().c_str());
  }
  return true;
}

void DemoRun::prepare(const std::vector<std::string>& checkpoints) {
  if (!rank0_) return;
  // Checkpoints of other settings are not resumed: the phase starts afresh.
  if (phase_.stale()) {
    std::printf("[%s] settings changed since its checkpoints were written: starting afresh\n", name().c_str());
    phase_.reset(checkpoints);
  }
  phase_.writeKey();
}

void DemoRun::resume(int64_t start, const std::string& note) {
  long long launches = 0;
  double elapsed = 0;
  if (start > 0 && std::sscanf(note.c_str(), "launch=%lld elapsed=%lf", &launches, &elapsed) == 2) {
    launch_ = launches + 1;
    elapsedBefore_ = elapsed;
  } else if (start > 0) {
    launch_ = 2; // a checkpoint without the note (written by another trainer)
  }
  if (start > 0 && rank0_) {
    std::printf("[%s] resumed from step %lld (launch %lld)\n", name().c_str(), static_cast<long long>(start),
                static_cast<long long>(launch_));
  }
  if (rank0_) phase_.openMetrics(start);
  t0_ = monotonicSeconds();
}

std::string DemoRun::resumeNote() const {
  return "launch=" + std::to_string(launch_) + " elapsed=" + std::to_string(elapsed());
}

double DemoRun::elapsed() const { return elapsedBefore_ + monotonicSeconds() - t0_; }

void DemoRun::line(const std::string& text) {
  if (!rank0_) return;
  if (live_) std::printf("\r\033[K");
  live_ = false;
  std::printf("%s\n", text.c_str());
}

// One live progress line on a terminal; otherwise a line every log_every steps.
void DemoRun::progress(const StepRecord& r) {
  char buf[240];
  int n = std::snprintf(buf, sizeof buf, "[%s] step %lld/%lld  loss %.4f", name().c_str(),
                        static_cast<long long>(r.step), static_cast<long long>(steps_), r.loss);
  if (r.hasKd) n += std::snprintf(buf + n, sizeof buf - n, " (ce %.4f, kd %.4f)", r.ce, r.kd);
  std::snprintf(buf + n, sizeof buf - n, "  tokens/s %.0f", r.tokensPerS);
  if (tty_) {
    std::printf("\r\033[K%s", buf);
    std::fflush(stdout);
    live_ = true;
  } else if (r.step % logEvery_ == 0 || r.step == steps_) {
    std::printf("%s\n", buf);
  }
}

void DemoRun::trained(const StepRecord& r) {
  if (!rank0_) return;
  progress(r);
  JsonLine rec;
  rec.add("phase", name()).add("launch", launch_).add("step", r.step).add("loss", r.loss).add("ce", r.ce);
  if (r.hasKd) rec.add("kd", r.kd);
  rec.add("lr", r.lr).add("step_ms", 1000 * r.seconds).add("tokens_per_s", r.tokensPerS).add("elapsed_s", elapsed());
  if (r.teacherWaitShare >= 0) rec.add("teacher_wait_share", r.teacherWaitShare);
  phase_.record(rec);
}

void DemoRun::validated(int64_t step, double valLoss) {
  if (!rank0_) return;
  phase_.record(JsonLine().add("phase", name()).add("launch", launch_).add("step", step).add("val_loss", valLoss));
  if (step == 0) return;
  char buf[160];
  std::snprintf(buf, sizeof buf, "[%s] step %lld/%lld  validation loss %.4f nats/byte", name().c_str(),
                static_cast<long long>(step), static_cast<long long>(steps_), valLoss);
  line(buf);
}

void DemoRun::checkpointed(int64_t step, bool saved, const std::string& why) {
  const std::string failed = why.empty() ? "checkpoint step " + std::to_string(step) + " not saved" : why;
  line("[" + name() + "] " + (saved ? "checkpoint saved at step " + std::to_string(step) : failed));
}

void DemoRun::stopped(int64_t step, bool saved, const std::string& why, bool checkpoints) {
  std::string text = "[" + name() + "] stopped at step " + std::to_string(step);
  if (!checkpoints) {
    text += " (checkpoint.dir is \"\": nothing saved, a rerun starts over)";
  } else if (saved) {
    text += " (checkpoint saved): run again to resume";
  } else {
    text += " (" + (why.empty() ? std::string("its checkpoint was not saved") : why) +
        "): run again to resume from the last checkpoint published";
  }
  line(text);
}

void DemoRun::finish(double valLoss, int64_t parameters, JsonLine extra) {
  if (!rank0_) return;
  const double seconds = elapsed();
  JsonLine done;
  done.add("val_loss", valLoss).add("steps", steps_).add("seconds", seconds).add("parameters", parameters);
  done.merge(extra);
  phase_.markDone(done);
  char buf[200];
  std::snprintf(buf, sizeof buf, "[%s] finished: %lld steps in %.1f s, validation loss %.4f", name().c_str(),
                static_cast<long long>(steps_), seconds, valLoss);
  line(buf);
}

} // namespace distill::examples
