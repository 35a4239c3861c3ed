#pragma once

// The demo's bookkeeping around a training loop, kept out of the loops
// themselves (train.cpp, alone.cpp): whether the phase is already finished,
// starting afresh when its settings changed, which launch this is and how long
// the earlier ones trained, the progress lines, metrics.jsonl and done.json.
// Only rank 0 of the students writes; every rank may call. No torch here.

#include <cstdint>
#include <string>
#include <vector>

#include "demo_support.h"

namespace distill::examples {

// The three phases of the demo.
// kDistilledCached: a second distilled student (other loss settings) whose
// teacher answers come from the output cache kDistilled wrote (trainer.phase).
enum class PhaseKind { kTeacher, kLabelOnly, kDistilled, kDistilledCached };

// Every setting a phase's result depends on except the number of steps (a run
// may be extended and resumes). `teacherServed`: the distilled phase's teacher
// ("kind:path@fingerprint"); ignored by the others.
std::string phaseKey(PhaseKind kind, const Config& cfg, const Settings& s, const std::string& dataPath,
                     uint64_t dataHash, const std::string& teacherServed);

// What one step reports (losses summed over micro-batches and students).
struct StepRecord {
  int64_t step = 0;
  double loss = 0, ce = 0, kd = 0;
  bool hasKd = false; // distilling: kd is one of the loss's parts
  double lr = 0;
  double seconds = 0; // this step's wall time
  double tokensPerS = 0; // of the whole step (every student)
  double teacherWaitShare = -1; // share of the step rank 0 spent waiting for the teacher (distilled; -1: none)
};

class DemoRun {
 public:
  DemoRun(const Config& cfg, PhaseKind kind, std::string key, int64_t steps, int64_t logEvery, bool rank0);

  const Phase& phase() const { return phase_; }
  const std::string& name() const { return phase_.name(); }
  bool rank0() const { return rank0_; }

  // done.json holds this key and these steps (and `alsoDone`): prints the skip line.
  bool finished(bool alsoDone = true);
  // Rank 0: removes `checkpoints` and the metrics of older settings, records the key.
  void prepare(const std::vector<std::string>& checkpoints);
  // After loading a checkpoint (start 0: none). `note`: what resumeNote() wrote then.
  void resume(int64_t start, const std::string& note);
  int64_t launch() const { return launch_; }
  // "launch=N elapsed=S": kept in the checkpoint, read back by resume().
  std::string resumeNote() const;
  double elapsed() const; // training seconds over every launch so far

  void line(const std::string& text); // rank 0
  void trained(const StepRecord& r);
  void validated(int64_t step, double valLoss);
  // A checkpoint at `step`; one that failed says why (`why`: the file and the error).
  void checkpointed(int64_t step, bool saved, const std::string& why = "");
  // Stopped before the last step; `checkpoints` false: checkpoint.dir is "" (nothing saved).
  void stopped(int64_t step, bool saved, const std::string& why = "", bool checkpoints = true);
  // Writes done.json (+ `extra` fields) and the closing line.
  void finish(double valLoss, int64_t parameters, JsonLine extra = {});

 private:
  void progress(const StepRecord& r);

  Phase phase_;
  int64_t steps_, logEvery_;
  bool rank0_, tty_, live_ = false;
  int64_t launch_ = 1;
  double elapsedBefore_ = 0;
  double t0_ = 0; // monotonic seconds at resume()
};

} // namespace distill::examples
