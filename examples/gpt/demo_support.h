#pragma once

// What the demo trainer needs besides the model and the data: its settings
// (the `trainer:` section of the config), flat JSON for metrics and state
// files (nlohmann-json), and a phase's folder (done marker, key, metrics.jsonl). No torch here.
//
// A phase (teacher, label_only, distilled) lives in <run.log_dir>/<phase>/:
//   phase.json     {"key": ...}: the settings the phase's checkpoints belong to
//   metrics.jsonl  one JSON object per line: train records and val records
//   done.json      written last: {"key","val_loss","steps","seconds"}
// A phase whose done.json has the current key and steps is finished: running
// the demo again skips it. A different key (settings changed) starts it afresh.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distill/core/options.h"
#include "gpt_options.h"

namespace distill::examples {

// ---- settings ----

struct Settings {
  std::string data = "/usr/share/common-licenses/GPL-3"; // any text file
  double valFraction = 0.1; // held-out tail of the file
  int64_t batch = 16; // sequences per student per micro-batch
  double lr = 3e-3; // AdamW peak learning rate (students)
  int64_t warmup = 50; // linear warm-up steps, then cosine decay
  double minLrRatio = 0.1; // the cosine ends at lr * this
  double weightDecay = 0.01;
  double gradClip = 1.0; // global gradient norm clip (0: off)
  int64_t evalEvery = 25; // validation every N steps (and at step 0 and the end)
  int64_t evalTokens = 4096; // validation tokens (consecutive windows of the held-out part)
  int64_t logEvery = 50; // a plain progress line every N steps when not on a terminal
  int threads = 1; // torch threads of each process of a distill-run job
  int threadsAlone = 1; // torch threads of a single-process phase (0: torch's default)
  GptOptions student; // student_layers, student_heads, student_dim (+ context)
  GptOptions teacher; // teacher_layers, teacher_heads, teacher_dim, teacher_dropout
  int64_t teacherSteps = 600;
  int64_t teacherBatch = 32; // sequences per teacher training step
  double teacherLr = 2e-3;
  std::string teacherWeights = "logs/demo/teacher/teacher.pt"; // what train-teacher writes
  // A distill job's phase folder: distilled, or distilled_cached (the demo's
  // second student, taught from the teacher cache the first one wrote).
  std::string phase = "distilled";

  // Reads cfg.trainer (ConfigError on an unknown key or a bad value, naming it).
  static Settings fromConfig(const Config& cfg);
  // Every key of the trainer section, for expectOnly and the docs.
  static std::vector<std::string> keys();
};

// Students of the job: the data-parallel world the label-only baseline replays.
int studentWorld(const Config& cfg);

// Learning rate at `step` (1-based) of `steps`: linear warm-up, cosine to minRatio.
double learningRate(double peak, int64_t step, int64_t steps, int64_t warmup, double minRatio);

// ---- flat JSON: one object, string / number values (nlohmann-json) ----

class JsonLine {
 public:
  JsonLine& add(const std::string& key, const std::string& value);
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, double value); // NaN, inf: null
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& merge(const JsonLine& other);
  std::string str() const { return obj_.dump(); } // one line

 private:
  nlohmann::ordered_json obj_ = nlohmann::ordered_json::object(); // keys in the order added
};

// Parses one flat object; values come back as text (strings unescaped,
// numbers as written). Throws std::runtime_error on anything else.
std::map<std::string, std::string> parseJson(const std::string& text);
// A number field, or `fallback` when absent.
double jsonNumber(const std::map<std::string, std::string>& obj, const std::string& key, double fallback);

// ---- files ----

std::string readText(const std::string& path); // "" when missing
// Publishes the finished file `tmp` as `path`: fsync, rename, fsync the folder,
// so that `path` is the old file or the whole new one, also after a crash.
void publishFile(const std::string& tmp, const std::string& path);
void writeTextAtomic(const std::string& path, const std::string& text); // tmp + publishFile
void makeDirs(const std::string& dir); // mkdir -p; runtime_error naming it
bool fileExists(const std::string& path);
void removeTree(const std::string& path); // rm -r; missing is fine

// ---- a phase's folder ----

class Phase {
 public:
  Phase(const std::string& logDir, const std::string& name, std::string key);

  const std::string& name() const { return name_; }
  const std::string& dir() const { return dir_; }
  const std::string& key() const { return key_; }
  std::string path(const std::string& file) const { return dir_ + "/" + file; }

  // done.json with this key and `steps`: the phase is finished.
  bool done(int64_t steps) const;
  std::map<std::string, std::string> doneRecord() const; // {} when not done
  // Whether the folder's phase.json names another key (its checkpoints are stale).
  bool stale() const;
  // Removes what belongs to a previous key (the given checkpoint paths,
  // metrics, done.json) and records this one.
  void reset(const std::vector<std::string>& checkpointPaths) const;
  void writeKey() const;
  // Writes done.json: this key and `record` (val_loss, steps, seconds, ...).
  void markDone(const JsonLine& record) const;

  // metrics.jsonl: keeps the records up to `step` (a resumed run redoes none
  // of them and rewrites none), then appends.
  void openMetrics(int64_t keepUpToStep);
  void record(const JsonLine& line);

 private:
  std::string name_, dir_, key_;
  std::string metrics_;
};

} // namespace distill::examples
