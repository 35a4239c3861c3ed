#pragma once

// Checkpoints that only students take part in: atomic, verified, exact resume
// (docs/design.md, "Checkpoints (ckpt/)").
//
// A CheckpointManager is built from a StudentContext only; every collective it
// issues runs on ctx.group(), the students' group. The teacher cannot make one
// (TeacherContext has no group), so it never touches the checkpoint directory
// and is never waited for: the checkpoint set-up hang of docs/design.md cannot happen.
//
// Layout under checkpoint.dir:
//   step_N.tmp/          being written (never loaded; ignored with a warning)
//   step_N/              published: manifest.json, model.pt, optimizer.pt,
//                        train_state.pt, rank_<r>.pt for every student rank r,
//                        config.yaml (dumpConfig of the run that saved it; on
//                        resume, the training keys that differ are named)
//   latest               "step_N": the commit point. A checkpoint is published
//                        once `latest` names it; loadLatest takes that one (or,
//                        if it is corrupt, the newest older one that verifies)
//                        and never a step_N/ newer than `latest`.
// Publishing: every rank writes and fsyncs its rank_<r>.pt into step_N.tmp/; the
// ranks agree (collective) that all did; student rank 0 writes the shared files
// and the manifest (step, student world size, config hash, teacher fingerprint,
// size and CRC32C of every file), fsyncs them and the directory, renames
// step_N.tmp -> step_N, fsyncs the root, then moves `latest` (write latest.tmp,
// fsync, rename, fsync the root) and removes what that superseded: every
// step_N.tmp/, every step_N/ newer than the new one, and all but the newest
// keep_last. A crash at any point leaves the previous checkpoint complete and
// `latest` naming it, or the new one complete and `latest` naming it
// (tests/ckpt/ckpt_test.cpp, KillDuringSaveTrials).
//
// Collectives and threads: every call below is collective — each student rank
// calls the same methods in the same order, from the thread that issues its
// training collectives (as with any c10d group). Sync mode agrees through the
// group (an all-reduce of every rank's outcome, a broadcast of rank 0's
// verdict). In async mode each rank's background writer does file I/O and
// exchanges notes (StudentGroup::notes, on the group's rendezvous store),
// never a collective: it writes the rank's files and posts that they are
// durable; student rank 0's writer awaits every rank's note, publishes, and
// posts the verdict, which every writer reads before it goes idle. So an async
// checkpoint is published as soon as every rank's files are durable, whether
// or not anything else is called; the next save(), wait() or loadLatest()
// reports its outcome, and the destructor waits for the writer: a save that
// returned is published (or its failure logged) before the manager is gone.
//
// Errors: a failed save (disk full, unwritable directory, ...) is a
// CheckpointError naming the path and strerror(errno) on the rank that failed;
// the others name that rank; every rank says which checkpoint is left in
// place (or that there is none). The previous checkpoint and the live model
// and optimizer are untouched. checkpoint.on_error=stop throws it on every
// rank; continue logs it and save() returns false on every rank. A peer lost
// during a sync save is the group's PeerLostError/TimeoutError (whatever
// on_error says); during an async one, a failed save (a rank that never
// reports within run.collective_timeout_s, or the store gone with rank 0).
//
// Space: keep_last is a most. When a save fails for want of space (ENOSPC,
// EDQUOT) on some ranks and nothing else, student rank 0 removes every partial
// step_N.tmp/, every uncommitted step_N/ and the oldest complete checkpoint —
// never the one loadLatest would take now — and every rank writes its files
// again, once. So a directory with room for two checkpoints keeps saving for
// ever; one with room for fewer cannot (the newest is never removed before a
// newer one is published), and the error says so.

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "distill/ckpt/file_system.h"
#include "distill/core/options.h"

namespace torch {
namespace nn {
class Module;
}
namespace optim {
class Optimizer;
}
} // namespace torch

namespace distill {

class StudentContext;
namespace ckpt_impl {
struct ModelRef;
}

// Where a data stream stands.
struct DataPosition {
  int64_t epoch = 0;
  int64_t index = 0; // next sample / batch within the epoch
};

// Shared training state: the same on every rank, saved once (by student rank 0).
struct TrainState {
  int64_t step = 0; // optimizer steps done
  int64_t accStep = 0; // micro-batch within the step (0 at a step boundary)
  int64_t tokensSeen = 0; // over all ranks
  DataPosition data; // global data position
  std::string extra; // user bytes, opaque
};

// Per-rank state, saved by each rank into its own file. With the torch default
// CPU generator (and the CUDA ones when the model is on CUDA) and the optional
// std::mt19937_64 given to save()/loadLatest(), it cannot be re-split over a
// different number of ranks.
struct RankState {
  DataPosition data; // this rank's position in its shard
  std::string extra; // user bytes, opaque
};

struct LoadedState {
  int64_t step = 0; // checkpoint step loaded
  std::string path; // its directory
  TrainState train;
  RankState rank; // this rank's
};

struct ManifestFile {
  std::string name; // relative to the checkpoint directory
  int64_t size = 0;
  uint32_t crc32c = 0;
};

// The manifest.json of a published checkpoint.
struct Manifest {
  int64_t step = 0;
  int studentWorldSize = 0;
  uint64_t configHash = 0; // configHash(config) of the run that saved it
  std::string teacherFingerprint; // as given to the manager ("" if none)
  // The fingerprint of the teacher whose answers trained it (noteAnswerTeacher; the slot header's
  // `teacher`): "answer_teacher", 16 hex digits, absent when 0 (none noted, or a manifest of 0.5.2 and before).
  uint64_t answerTeacher = 0;
  std::vector<ManifestFile> files;

  const ManifestFile* find(const std::string& name) const;
};

// The manifest as JSON (written and read with nlohmann-json), its last line
// but one the CRC32C of every byte before it. parseManifest checks that CRC
// before parsing anything, refuses nesting deeper than 8 levels before
// parsing, then checks every field; any problem is a CheckpointError naming
// `path` and what is wrong ("checksum ... recorded, ... computed", "invalid
// JSON: ... '\u' must be followed by 4 hex digits", "field \"step\" missing").
std::string formatManifest(const Manifest& m);
Manifest parseManifest(const std::string& text, const std::string& path);

// Checks a published checkpoint directory: manifest intact, every file present
// with its size and checksum, the rank files of every rank listed. Returns the
// manifest; throws CheckpointError naming the first bad file. Reads every file.
Manifest verifyCheckpoint(const std::string& stepDir, FileSystem& fs);

// What loadLatest finds in a checkpoint directory (student rank 0 runs it).
// `latest` is the commit point: the checkpoint it names and the older complete
// ones are the candidates, newest first, and the first that verifies is
// chosen. A step_N/ newer than `latest` (a save interrupted between renaming
// its directory and moving `latest`) and every step_N.tmp/ are never loaded.
// Without a `latest` that names an existing checkpoint (a directory written
// before there was one, or edited by hand) every complete one is a candidate.
struct CheckpointScan {
  std::optional<Manifest> chosen; // the checkpoint to load, verified
  std::string chosenDir;
  int64_t latest = -1; // the step `latest` names; -1: none (or unreadable)
  std::vector<std::string> rejected; // "<dir>: why" for each candidate that failed, newest first
  std::vector<std::string> skipped; // warnings: partial and uncommitted ones, a bad `latest`
};
// Throws CheckpointError only when `root` cannot be listed.
CheckpointScan scanCheckpoints(const std::string& root, FileSystem& fs);

// The training keys (those configHash covers; see configEntries) whose values
// differ between the config a checkpoint was saved under — its config.yaml,
// dumpConfig() of that run — and `now`, in schema order, each
// "key: <saved> -> <now>" with the values as dumpConfig writes them ("(unset)"
// for a trainer key one side lacks). Throws ConfigError when `savedYaml` is
// not a dumpConfig() text.
std::vector<std::string> configChanges(const std::string& savedYaml, const Config& now);

class CheckpointManager {
 public:
  // `ctx` must outlive the manager.
  // Collective (all student ranks): rank 0 creates opts.dir (mkdir -p), then a
  // student-group barrier that also carries rank 0's outcome, so a failure is
  // a CheckpointError on every rank. opts.dir == "" makes a disabled manager:
  // save() returns false, loadLatest() nullopt, nothing is touched or awaited.
  // `teacherFingerprint` identifies the teacher (e.g. its weights' hash); a
  // mismatch on load is a warning. `fs`: null for the POSIX file system.
  explicit CheckpointManager(StudentContext& ctx);
  CheckpointManager(StudentContext& ctx, CheckpointOptions opts, std::string teacherFingerprint = "",
                    std::shared_ptr<FileSystem> fs = nullptr);
  // Async: waits (bounded by 3 x run.collective_timeout_s) for the background
  // writer to finish the save in flight — its files, the other ranks' notes,
  // publication on rank 0, the verdict — and logs its failure, if any. No
  // collective: it is safe on every exit path, exceptions included.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  bool enabled() const;
  const CheckpointOptions& options() const;
  // True when checkpoint.every_steps > 0 divides `step`.
  bool due(int64_t step) const;

  // Collective. Saves checkpoint `step` (directory step_<step>; normally
  // train.step). Reads model and optimizer, never changes them.
  // Sync: returns once it is published and durable on every rank.
  // Async: first waits for the previous async save and reports its outcome;
  // then, in this thread, copies the model's parameters and buffers to CPU and
  // serializes the optimizer state into memory (torch's Optimizer offers no
  // deep copy), and hands serialization of the copies, all file I/O and the
  // publication (see above) to the background thread; returns before the
  // files are written. The caller may then update model and optimizer at once.
  // A failure of the background work surfaces at the next save(), wait() or
  // loadLatest() (or is logged by the destructor).
  // Returns false when a checkpoint failed and on_error=continue (this one, or
  // in async mode the previous one); throws CheckpointError when on_error=stop.
  bool save(int64_t step, torch::nn::Module& model, torch::optim::Optimizer& optimizer, const TrainState& train,
            const RankState& rank = {}, std::mt19937_64* rng = nullptr);

  // Collective. Waits for the async save in flight, if any (its files and its
  // publication), and reports its outcome like save(). Sync mode: true. Not
  // needed before destruction; useful to learn the last save's outcome.
  bool wait();

  // Why the last save(), saveBytes() or wait() that returned false failed, as
  // the log words it: "checkpoint step N not saved: " and the file and
  // strerror(errno) on the rank that failed (the failed ranks on the others),
  // and which checkpoint is left in place. "" after a call that returned true
  // (and after save() on a disabled manager, which saves nothing).
  const std::string& lastError() const;

  // The teacher whose answers train the model: TeacherReply::teacherFingerprint() of each answer
  // (distill::Steps notes every one; a trainer of its own calls it). Every checkpoint published after
  // records the last one noted (the manifest's "answer_teacher"). After loadLatest, the first one
  // noted that differs from the checkpoint's is a warning naming both (training goes on with this
  // run's teacher). 0 ("not stated") is ignored. Not collective; the caller's thread.
  void noteAnswerTeacher(uint64_t fingerprint);
  // The answer teacher of the checkpoint loadLatest loaded (every rank); 0 when none was recorded or
  // nothing was loaded.
  uint64_t resumedAnswerTeacher() const;

  // Collective. Loads the published checkpoint (scanCheckpoints: the one
  // `latest` names, or the newest older one that verifies) into `model` and
  // `optimizer` (on the device of the model's parameters), restores this
  // rank's RNG states (`rng` too, when given) and returns the train and rank
  // state; nullopt when there is none (clean start: no checkpoint, or only
  // partial ones). Rank 0 chooses (partial, uncommitted and corrupt
  // checkpoints are skipped with a warning naming them and why) and broadcasts
  // the step, so every rank loads the same one. Checkpoints present but every
  // one corrupt: a CheckpointError on every rank naming each and why
  // (checkpoint.on_corrupt=error), or a warning and nullopt (restart); nothing
  // is removed. A checkpoint of a different student world size is a
  // CheckpointError: per-rank state cannot be re-split. Any rank failing to
  // load is a CheckpointError on every rank.
  std::optional<LoadedState> loadLatest(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                        std::mt19937_64* rng = nullptr);

  // The same two for a trainer whose model is not a torch::nn::Module (the
  // Python binding): model.pt and optimizer.pt hold the bytes given, as they
  // are (torch.save of the state dicts); loadLatestBytes hands them back only
  // once every file of the checkpoint verified. `cuda`: the model lives on a
  // GPU, so the CUDA generators' states are saved (and restored) too.
  bool saveBytes(int64_t step, std::string modelBytes, std::string optimizerBytes, const TrainState& train,
                 const RankState& rank = {}, bool cuda = false);
  std::optional<LoadedState> loadLatestBytes(std::string& modelBytes, std::string& optimizerBytes, bool cuda = false);

 private:
  bool saveRef(int64_t step, const ckpt_impl::ModelRef& state, const TrainState& train, const RankState& rank,
               std::mt19937_64* rng);
  std::optional<LoadedState> loadRef(const ckpt_impl::ModelRef& state, std::mt19937_64* rng);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace distill
