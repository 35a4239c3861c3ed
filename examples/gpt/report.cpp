#include "report.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "demo_support.h"

namespace distill::examples {
namespace {

struct PhaseResult {
  std::string name;
  std::map<std::string, std::string> done; // done.json ({} if missing)
  double valLoss() const { return jsonNumber(done, "val_loss", NAN); }
  double seconds() const { return jsonNumber(done, "seconds", 0); }
};

PhaseResult readPhase(const std::string& logDir, const std::string& name) {
  PhaseResult r;
  r.name = name;
  const std::string done = readText(logDir + "/" + name + "/done.json");
  if (!done.empty()) r.done = parseJson(done);
  return r;
}

// The plot is drawn by matplotlib: examples/gpt/plot.py, run with the build's
// Python (cmake's DISTILL_PYTHON; DISTILL_GPT_PLOT names another script).
// Returns its exit status.
int drawPlot(const std::string& logDir) {
  const char* env = std::getenv("DISTILL_GPT_PLOT");
  std::string script = env && *env ? env : DISTILL_GPT_PLOT_SCRIPT;
  std::string python = DISTILL_GPT_PYTHON;
  std::vector<char*> argv{python.data(), script.data(), const_cast<char*>(logDir.c_str()), nullptr};
  pid_t pid = -1;
  if (const int err = ::posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ)) {
    std::fprintf(stderr, "report: cannot start %s %s: %s\n", python.c_str(), script.c_str(), std::strerror(err));
    return 127;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return 127;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct CacheFigures {
  double hitShare = 0, bytes = 0, bytesPerToken = 0, temperature = 0;
  std::string file;
};

// The cached phase's hit share (its done.json) and what the cache costs on
// disk: the blocks data.mdb occupies (LMDB's map is sparse) over the tokens
// the distilled phase had the teacher answer.
CacheFigures cacheFigures(const Config& cfg, int64_t steps, const PhaseResult& cached) {
  CacheFigures f;
  f.hitShare = jsonNumber(cached.done, "teacher_cache_hit_share", NAN);
  f.temperature = jsonNumber(cached.done, "temperature", NAN);
  f.file = cfg.teacher.cache.path + "/data.mdb";
  struct stat st {};
  if (::stat(f.file.c_str(), &st) == 0) f.bytes = static_cast<double>(st.st_blocks) * 512.0;
  const Settings s = Settings::fromConfig(cfg);
  const double tokens = static_cast<double>(steps) * studentWorld(cfg) * cfg.student.grad_acc_steps * s.batch *
      static_cast<double>(s.student.context);
  f.bytesPerToken = tokens > 0 ? f.bytes / tokens : NAN;
  return f;
}

} // namespace

int report(const Config& cfg) {
  const std::string& logDir = cfg.run.log_dir;
  PhaseResult teacher = readPhase(logDir, "teacher");
  PhaseResult labelOnly = readPhase(logDir, "label_only");
  PhaseResult distilled = readPhase(logDir, "distilled");
  for (const PhaseResult* p : {&teacher, &labelOnly, &distilled}) {
    if (p->done.empty()) {
      std::fprintf(stderr, "report: phase %s is not finished (%s/%s/done.json missing)\n", p->name.c_str(),
                   logDir.c_str(), p->name.c_str());
      return 1;
    }
  }
  const int64_t steps = static_cast<int64_t>(jsonNumber(distilled.done, "steps", 0));
  if (static_cast<int64_t>(jsonNumber(labelOnly.done, "steps", -1)) != steps) {
    std::fprintf(stderr, "report: label-only ran %lld steps, the distilled run %lld: not comparable\n",
                 static_cast<long long>(jsonNumber(labelOnly.done, "steps", -1)), static_cast<long long>(steps));
    return 1;
  }

  // The demo's second student (demo.sh phase 4), taught from the teacher cache: optional.
  PhaseResult cached = readPhase(logDir, "distilled_cached");
  const bool hasCached = !cached.done.empty();
  const double seconds =
      teacher.seconds() + labelOnly.seconds() + distilled.seconds() + (hasCached ? cached.seconds() : 0);
  JsonLine summary;
  summary.add("teacher_val_loss", teacher.valLoss())
      .add("label_only_val_loss", labelOnly.valLoss())
      .add("distilled_val_loss", distilled.valLoss())
      .add("steps", steps)
      .add("seconds", seconds);
  CacheFigures cache;
  if (hasCached) {
    cache = cacheFigures(cfg, steps, cached);
    summary.add("distilled_cached_val_loss", cached.valLoss())
        .add("teacher_cache_hit_share", cache.hitShare)
        .add("label_only_seconds", labelOnly.seconds())
        .add("distilled_seconds", distilled.seconds())
        .add("distilled_cached_seconds", cached.seconds())
        .add("cache_bytes_per_token", cache.bytesPerToken);
  }
  writeTextAtomic(logDir + "/summary.json", summary.str() + "\n");

  auto params = [](const PhaseResult& p) { return jsonNumber(p.done, "parameters", 0) / 1e6; };
  std::printf("\n%-22s %12s %12s %10s\n", "model", "parameters", "val loss", "train s");
  std::printf("%-22s %11.2fM %12.4f %10.1f\n", "teacher", params(teacher), teacher.valLoss(), teacher.seconds());
  std::printf("%-22s %11.2fM %12.4f %10.1f\n", "label-only student", params(labelOnly), labelOnly.valLoss(),
              labelOnly.seconds());
  std::printf("%-22s %11.2fM %12.4f %10.1f\n", "distilled student", params(distilled), distilled.valLoss(),
              distilled.seconds());
  if (hasCached) {
    std::printf("%-22s %11.2fM %12.4f %10.1f\n", "2nd distilled, cached", params(cached), cached.valLoss(),
                cached.seconds());
  }
  const double gain = labelOnly.valLoss() - distilled.valLoss();
  std::printf("\nvalidation loss in nats per byte on the held-out %s; %lld student steps.\n", "tail of the data",
              static_cast<long long>(steps));
  if (gain > 0) {
    std::printf("the distilled student beats the label-only one by %.4f nats/byte (%.1f%%).\n", gain,
                100 * gain / labelOnly.valLoss());
  } else {
    std::printf("the distilled student does NOT beat the label-only one (%+.4f nats/byte).\n", -gain);
  }
  if (hasCached) {
    std::printf(
        "the 2nd distilled student (loss.temperature %g) took %.1f%% of its teacher answers from the cache "
        "the 1st wrote: %.1f s, %.2fx the label-only student's time for the same tokens (the 1st, through "
        "the teacher: %.2fx); the cache holds %.0f bytes per token taught (%s, %.1f MiB).\n",
        cache.temperature, 100 * cache.hitShare, cached.seconds(), cached.seconds() / labelOnly.seconds(),
        distilled.seconds() / labelOnly.seconds(), cache.bytesPerToken, cache.file.c_str(), cache.bytes / 1048576.0);
  }
  // Last: the table and summary.json stand even when the plot cannot be drawn.
  const std::string png = logDir + "/val_loss.png";
  if (const int rc = drawPlot(logDir)) {
    std::fprintf(stderr,
                 "report: the plot %s was not drawn (%s %s exited with %d); matplotlib is installed by "
                 "`bash cmake/distill.sh demo`\n",
                 png.c_str(), DISTILL_GPT_PYTHON, DISTILL_GPT_PLOT_SCRIPT, rc);
    return 1;
  }
  std::printf("plot: %s\nsummary: %s/summary.json\n", png.c_str(), logDir.c_str());
  return 0;
}

} // namespace distill::examples
