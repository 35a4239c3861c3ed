#include "demo_support.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "distill/core/errors.h"
#include "distill/core/strings.h"
#include "distill/core/sys.h" // makeDirs

namespace distill::examples {

// ---- GptOptions (declared in gpt_options.h) ----

int64_t GptOptions::parameterCount() const {
  const int64_t block =
      2 * 2 * dim + (dim * 3 * dim + 3 * dim) + (dim * dim + dim) + (dim * 4 * dim + 4 * dim) + (4 * dim * dim + dim);
  return vocab * dim + context * dim + layers * block + 2 * dim + dim * vocab;
}

std::string GptOptions::describe() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%lld layers x %lld dim, %lld heads, context %lld (%.2fM parameters)",
                static_cast<long long>(layers), static_cast<long long>(dim), static_cast<long long>(heads),
                static_cast<long long>(context), static_cast<double>(parameterCount()) / 1e6);
  return buf;
}

// ---- settings ----

std::vector<std::string> Settings::keys() {
  return {"data",
          "val_fraction",
          "context",
          "batch",
          "lr",
          "warmup",
          "min_lr_ratio",
          "weight_decay",
          "grad_clip",
          "eval_every",
          "eval_tokens",
          "log_every",
          "threads",
          "threads_alone",
          "student_layers",
          "student_heads",
          "student_dim",
          "teacher_layers",
          "teacher_heads",
          "teacher_dim",
          "teacher_dropout",
          "teacher_steps",
          "teacher_batch",
          "teacher_lr",
          "teacher_weights",
          "phase"};
}

Settings Settings::fromConfig(const Config& cfg) {
  const TrainerOptions& t = cfg.trainer;
  t.expectOnly(keys());
  Settings s;
  s.data = t.getString("data", s.data);
  s.valFraction = t.getDouble("val_fraction", s.valFraction);
  const int64_t context = t.getInt("context", s.student.context);
  s.batch = t.getInt("batch", s.batch);
  s.lr = t.getDouble("lr", s.lr);
  s.warmup = t.getInt("warmup", s.warmup);
  s.minLrRatio = t.getDouble("min_lr_ratio", s.minLrRatio);
  s.weightDecay = t.getDouble("weight_decay", s.weightDecay);
  s.gradClip = t.getDouble("grad_clip", s.gradClip);
  s.evalEvery = t.getInt("eval_every", s.evalEvery);
  s.evalTokens = t.getInt("eval_tokens", s.evalTokens);
  s.logEvery = t.getInt("log_every", s.logEvery);
  s.threads = static_cast<int>(t.getInt("threads", s.threads));
  s.threadsAlone = static_cast<int>(t.getInt("threads_alone", s.threadsAlone));
  s.student.context = s.teacher.context = context;
  s.student.layers = t.getInt("student_layers", 2);
  s.student.heads = t.getInt("student_heads", 4);
  s.student.dim = t.getInt("student_dim", 64);
  s.teacher.layers = t.getInt("teacher_layers", 4);
  s.teacher.heads = t.getInt("teacher_heads", 4);
  s.teacher.dim = t.getInt("teacher_dim", 128);
  s.teacher.dropout = t.getDouble("teacher_dropout", 0.1);
  s.teacherSteps = t.getInt("teacher_steps", s.teacherSteps);
  s.teacherBatch = t.getInt("teacher_batch", s.teacherBatch);
  s.teacherLr = t.getDouble("teacher_lr", s.teacherLr);
  s.teacherWeights = t.getString("teacher_weights", s.teacherWeights);
  s.phase = t.getString("phase", s.phase);

  // Ranges: the trainer's own checks, reported like distill's.
  std::vector<std::string> bad;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) bad.push_back("trainer." + what);
  };
  need(s.valFraction > 0 && s.valFraction < 1, "val_fraction: must be in (0, 1)");
  need(context >= 2, "context: must be >= 2");
  need(s.phase == "distilled" || s.phase == "distilled_cached",
       "phase: must be distilled or distilled_cached, found \"" + s.phase + "\"");
  need(s.batch >= 1, "batch: must be >= 1");
  need(s.lr > 0 && s.teacherLr > 0, "lr, teacher_lr: must be > 0");
  need(s.warmup >= 0, "warmup: must be >= 0");
  need(s.minLrRatio >= 0 && s.minLrRatio <= 1, "min_lr_ratio: must be in [0, 1]");
  need(s.gradClip >= 0, "grad_clip: must be >= 0");
  need(s.evalEvery >= 1 && s.evalTokens >= context && s.logEvery >= 1,
       "eval_every, log_every: must be >= 1; eval_tokens: must be >= context");
  need(s.threads >= 0 && s.threadsAlone >= 0, "threads, threads_alone: must be >= 0");
  for (const auto* g : {&s.student, &s.teacher}) {
    const std::string who = g == &s.student ? "student" : "teacher";
    need(g->layers >= 1 && g->dim >= 1 && g->heads >= 1 && g->dim % g->heads == 0,
         who + "_layers, " + who + "_dim, " + who + "_heads: must be >= 1, heads dividing dim");
  }
  need(s.teacher.dropout >= 0 && s.teacher.dropout < 1, "teacher_dropout: must be in [0, 1)");
  need(s.teacherSteps >= 1 && s.teacherBatch >= 1, "teacher_steps, teacher_batch: must be >= 1");
  need(!s.teacherWeights.empty(), "teacher_weights: must not be empty");
  if (!bad.empty()) {
    std::string msg = "config " + cfg.trainer.source + ": " + std::to_string(bad.size()) + " problem(s):";
    for (auto& b : bad) msg += "\n" + b;
    DISTILL_THROW(ConfigError, msg);
  }
  return s;
}

int studentWorld(const Config& cfg) { return cfg.run.nnodes * (cfg.run.nproc_per_node - 1); }

double learningRate(double peak, int64_t step, int64_t steps, int64_t warmup, double minRatio) {
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, steps - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  return peak * (minRatio + (1 - minRatio) * 0.5 * (1 + std::cos(M_PI * progress)));
}

// ---- JSON ----

JsonLine& JsonLine::add(const std::string& key, const std::string& value) {
  obj_[key] = value;
  return *this;
}

JsonLine& JsonLine::add(const std::string& key, double value) {
  if (std::isfinite(value))
    obj_[key] = value;
  else
    obj_[key] = nullptr;
  return *this;
}

JsonLine& JsonLine::add(const std::string& key, int64_t value) {
  obj_[key] = value;
  return *this;
}

JsonLine& JsonLine::merge(const JsonLine& other) {
  for (const auto& [key, value] : other.obj_.items()) obj_[key] = value;
  return *this;
}

std::map<std::string, std::string> parseJson(const std::string& text) {
  nlohmann::json obj;
  try {
    obj = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("json: ") + e.what() + " in: " + text.substr(0, 200));
  }
  if (!obj.is_object()) throw std::runtime_error("json: expected an object in: " + text.substr(0, 200));
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : obj.items()) out[key] = value.is_string() ? value.get<std::string>() : value.dump();
  return out;
}

double jsonNumber(const std::map<std::string, std::string>& obj, const std::string& key, double fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->second == "null") return fallback;
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  return end && *end == '\0' ? v : fallback;
}

// ---- files ----

std::string readText(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) return "";
  std::string out;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) out.append(buf, n);
  return out;
}

namespace {

void fsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error("cannot fsync " + path + ": " + std::strerror(err));
}

} // namespace

void publishFile(const std::string& tmp, const std::string& path) {
  fsyncPath(tmp, O_RDONLY);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  }
  const size_t slash = path.rfind('/');
  fsyncPath(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash), O_RDONLY | O_DIRECTORY);
}

void writeTextAtomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + tmp + ": " + std::strerror(errno));
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(err));
    }
    off += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) throw std::runtime_error("cannot close " + tmp + ": " + std::strerror(errno));
  publishFile(tmp, path);
}

void makeDirs(const std::string& dir) {
  std::string at;
  if (const int err = distill::makeDirs(dir, &at))
    throw std::runtime_error("cannot create " + at + ": " + std::strerror(err));
}

bool fileExists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void removeTree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") removeTree(path + "/" + name);
      }
      ::closedir(d);
    }
    if (::rmdir(path.c_str()) != 0) throw std::runtime_error("cannot remove " + path + ": " + std::strerror(errno));
  } else if (::unlink(path.c_str()) != 0) {
    throw std::runtime_error("cannot remove " + path + ": " + std::strerror(errno));
  }
}

// ---- phase ----

Phase::Phase(const std::string& logDir, const std::string& name, std::string key)
    : name_(name), dir_(logDir + "/" + name), key_(std::move(key)) {}

std::map<std::string, std::string> Phase::doneRecord() const {
  const std::string text = readText(path("done.json"));
  if (text.empty()) return {};
  auto rec = parseJson(text);
  return rec["key"] == key_ ? rec : std::map<std::string, std::string>{};
}

bool Phase::done(int64_t steps) const {
  auto rec = doneRecord();
  return !rec.empty() && static_cast<int64_t>(jsonNumber(rec, "steps", -1)) == steps;
}

bool Phase::stale() const {
  const std::string text = readText(path("phase.json"));
  return !text.empty() && parseJson(text)["key"] != key_;
}

void Phase::reset(const std::vector<std::string>& checkpointPaths) const {
  for (const std::string& p : checkpointPaths) removeTree(p);
  removeTree(path("metrics.jsonl"));
  removeTree(path("done.json"));
  writeKey();
}

void Phase::writeKey() const {
  makeDirs(dir_);
  writeTextAtomic(path("phase.json"), JsonLine().add("key", key_).str() + "\n");
}

void Phase::markDone(const JsonLine& record) const {
  writeTextAtomic(path("done.json"), JsonLine().add("key", key_).merge(record).str() + "\n");
}

void Phase::openMetrics(int64_t keepUpToStep) {
  metrics_ = path("metrics.jsonl");
  std::string kept;
  std::istringstream in(readText(metrics_));
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    try {
      if (jsonNumber(parseJson(line), "step", 1e18) <= static_cast<double>(keepUpToStep)) kept += line + "\n";
    } catch (const std::runtime_error&) {
      // A line cut short by an interruption: dropped.
    }
  }
  writeTextAtomic(metrics_, kept);
}

void Phase::record(const JsonLine& line) {
  if (metrics_.empty()) return;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(metrics_.c_str(), "ab"), &std::fclose);
  if (!f) throw std::runtime_error("cannot append to " + metrics_ + ": " + std::strerror(errno));
  const std::string text = line.str() + "\n";
  std::fwrite(text.data(), 1, text.size(), f.get());
}

} // namespace distill::examples
