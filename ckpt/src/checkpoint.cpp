#include "distill/ckpt/checkpoint.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "checkpoint_impl.h"
#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/group/student_context.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/strings.h"
#include "distill/group/student_group.h"
#include "distill/core/trace.h"
#include "layout.h"

namespace distill {

using namespace ckpt_impl;

struct CheckpointManager::Impl {
  StudentGroup* group = nullptr;
  std::shared_ptr<CheckpointCore> core;
  int64_t saveSeq = 0; // async saves so far: the same on every rank (save() is collective)
  std::string lastError; // failSave's text of the last save()/wait() that failed ("" after one that did not)
  uint64_t resumedTeacher = 0; // the loaded checkpoint's answer_teacher (0: none)
  bool teacherChecked = false; // the first differing answer teacher after a resume was logged

  // Async only.
  std::shared_ptr<Writer> writer;
  std::thread writerThread;
  struct Pending {
    int64_t step;
    std::string tmpDir;
    std::shared_ptr<AsyncResult> result;
  };
  std::optional<Pending> pending;

  // How long the caller waits for the writer: its own writing, a wait for the
  // other ranks' notes (rank 0) or for the verdict (the others), acks.
  Millis writerPatience() const { return 3 * core->timeout; }

  // on_error policy for a failed save; every rank calls it with the same outcome.
  bool failSave(int64_t step, const std::string& why) {
    const std::string text = "checkpoint step " + std::to_string(step) + " not saved: " + why;
    lastError = text;
    if (core->opts.on_error == OnSaveError::kContinue) {
      DISTILL_LOG(kError) << text << " (checkpoint.on_error=continue: training goes on)";
      return false;
    }
    DISTILL_THROW(CheckpointError, ErrorWhere{step, std::nullopt, ""}, text);
  }

  // Sync save, caller's thread. Every rank reports (all-reduce) whether its
  // files of `step` are durable, with its rank file's size and CRC; rank 0
  // decides (CheckpointCore::decide) and broadcasts the verdict, the barrier
  // after which the checkpoint is durable everywhere. Out of space: once,
  // rank 0 makes room and every rank writes its files again.
  bool saveSync(int64_t step, const std::string& tmpDir, std::vector<OutFile>& files, const std::string& snapError) {
    CheckpointCore& c = *core;
    const std::string tag = "checkpoint step " + std::to_string(step);
    for (int attempt = 0;; ++attempt) {
      WriteResult mine;
      if (snapError.empty()) {
        mine = writeFiles(*c.fs, tmpDir, files);
      } else {
        mine.error = snapError;
      }
      auto table = torch::zeros({c.world, 4}, torch::kLong); // failed, size, crc, no space
      {
        auto acc = table.accessor<int64_t, 2>();
        const ManifestFile* own = nullptr;
        for (const auto& f : mine.files) {
          if (f.name == rankFile(c.rank)) own = &f;
        }
        if (!mine.error.empty() || !own) {
          acc[c.rank][0] = 1;
          acc[c.rank][3] = mine.noSpace ? 1 : 0;
        } else {
          acc[c.rank][1] = own->size;
          acc[c.rank][2] = own->crc32c;
        }
      }
      group->allReduce(table, ReduceOp::kSum, tag + ": rank files written");
      auto acc = table.accessor<int64_t, 2>();
      std::vector<RankReport> reports(c.world);
      for (int r = 0; r < c.world; ++r) {
        reports[r].state = acc[r][0] != 0 ? RankReport::kFailed : RankReport::kWritten;
        reports[r].noSpace = acc[r][3] != 0;
        reports[r].size = acc[r][1];
        reports[r].crc = static_cast<uint32_t>(acc[r][2]);
      }
      std::string publishError;
      auto out = torch::zeros({4}, torch::kLong); // code, publish failed, full, kept
      if (c.rank == 0) {
        Verdict v = c.decide(step, attempt, tmpDir, mine, reports, &publishError);
        out = torch::tensor({v.code, int64_t{v.publishFailed}, int64_t{v.full}, v.kept});
      }
      group->broadcast(out, 0, tag + ": published");
      Verdict v;
      v.code = out[0].item<int64_t>();
      v.publishFailed = out[1].item<int64_t>() != 0;
      v.full = out[2].item<int64_t>() != 0;
      v.kept = out[3].item<int64_t>();
      for (int r = 0; r < c.world; ++r) {
        if (reports[r].state == RankReport::kFailed) v.failed.push_back(r);
      }
      if (v.code == Verdict::kPublished) return true;
      if (v.code == Verdict::kRetry) continue;
      if (c.rank == 0) c.removeTmp(tmpDir); // every rank is done with it
      return failSave(step, c.failureText(v, mine.error.empty() ? publishError : mine.error));
    }
  }

  // The async save in flight, if any: waits (bounded) for the writer, which
  // has published it or not by then, and reports the outcome like save().
  bool finishPending() {
    if (!pending) return true;
    Pending p = std::move(*pending);
    pending.reset();
    if (!writer->waitIdle(Deadline::after(writerPatience()))) {
      return failSave(p.step,
                      "the background writer is still writing or publishing " + p.tmpDir + " after " +
                          std::to_string(writerPatience().count()) + " ms (3 x run.collective_timeout_s)");
    }
    if (p.result->ok) return true; // the writer is idle: its result happens-before (mutex)
    return failSave(p.step, p.result->error);
  }
};

CheckpointManager::CheckpointManager(StudentContext& ctx) : CheckpointManager(ctx, ctx.config().checkpoint) {}

CheckpointManager::CheckpointManager(StudentContext& ctx, CheckpointOptions opts, std::string teacherFingerprint,
                                     std::shared_ptr<FileSystem> fs)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.core = std::make_shared<CheckpointCore>();
  CheckpointCore& c = *s.core;
  s.group = &ctx.group();
  c.opts = std::move(opts);
  while (c.opts.dir.size() > 1 && c.opts.dir.back() == '/') c.opts.dir.pop_back();
  c.fingerprint = std::move(teacherFingerprint);
  c.fs = fs ? std::move(fs)
             : posixFileSystem(fileModeBits(ctx.config().run.file_mode), dirModeBits(ctx.config().run.file_mode));
  c.cfgHash = configHash(ctx.config());
  c.config = ctx.config();
  c.configYaml = dumpConfig(c.config);
  c.rank = ctx.rank();
  c.world = ctx.worldSize();
  c.timeout = s.group->timeout();
  DISTILL_CHECK_T(ConfigError, c.opts.on_error == OnSaveError::kStop || c.opts.on_error == OnSaveError::kContinue,
                  "checkpoint.on_error must be stop or continue, got value ", static_cast<int>(c.opts.on_error));
  DISTILL_CHECK_T(ConfigError, c.opts.keep_last >= 1, "checkpoint.keep_last must be >= 1, got ", c.opts.keep_last);
  DISTILL_CHECK_T(ConfigError, c.opts.on_corrupt == OnCorrupt::kError || c.opts.on_corrupt == OnCorrupt::kRestart,
                  "checkpoint.on_corrupt must be error or restart, got value ", static_cast<int>(c.opts.on_corrupt));
  if (c.opts.dir.empty()) return; // disabled, on every rank alike (same config)

  // Rank 0 makes the directory; the broadcast is the student-group barrier
  // (docs/design.md, the checkpoint set-up hang: the teacher is not in this group) and carries the
  // outcome and a random id for this manager's notes (a store that outlives a
  // restarted job, like torchrun's agent store, may hold an earlier one's).
  std::string err;
  int64_t id = 0;
  if (c.rank == 0) {
    id = static_cast<int64_t>(std::random_device{}() & 0x7fffffffu) << 31 | (std::random_device{}() & 0x7fffffffu);
    try {
      c.fs->createDirs(c.opts.dir);
      c.fs->syncDir(c.opts.dir);
      auto slash = c.opts.dir.rfind('/');
      c.fs->syncDir(slash == std::string::npos ? "." : slash == 0 ? "/" : c.opts.dir.substr(0, slash));
    } catch (const std::exception& e) {
      err = messageOf(e);
    }
  }
  auto flag = torch::tensor({static_cast<int64_t>(!err.empty()), id}, torch::kLong);
  s.group->broadcast(flag, 0, "checkpoint directory " + c.opts.dir);
  DISTILL_CHECK_T(CheckpointError, flag[0].item<int64_t>() == 0, "checkpoint directory: ",
                  err.empty() ? "student rank 0 could not create " + c.opts.dir + " (its log says why)" : err);
  if (c.opts.async) {
    c.notes = s.group->notes("ckpt-" + std::to_string(flag[1].item<int64_t>()));
    s.writer = std::make_shared<Writer>();
    s.writerThread = std::thread(Writer::loop, s.writer);
  }
}

CheckpointManager::~CheckpointManager() {
  auto& s = *impl_;
  if (!s.writer) return;
  // Publishes what save() reported saved: the writer does it (file I/O and
  // notes, no collective), so only waiting is left here.
  const bool idle = s.writer->waitIdle(Deadline::after(s.writerPatience()));
  if (s.pending) {
    if (!idle) {
      DISTILL_LOG(kError) << "checkpoint step " << s.pending->step << ": the background writer is still writing or "
                          << "publishing " << s.pending->tmpDir << " after " << s.writerPatience().count()
                          << " ms; abandoning it (the newest published checkpoint stays the one to load)";
    } else if (!s.pending->result->ok) {
      DISTILL_LOG(kError) << "checkpoint step " << s.pending->step
                          << " not saved (reported as the CheckpointManager is destroyed): "
                          << s.pending->result->error;
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.writer->mu);
    s.writer->stop = true;
    s.writer->cv.notify_all();
  }
  if (idle) {
    s.writerThread.join();
  } else {
    s.writerThread.detach(); // it owns what it uses (shared state, its task)
  }
}

bool CheckpointManager::enabled() const { return !impl_->core->opts.dir.empty(); }
const CheckpointOptions& CheckpointManager::options() const { return impl_->core->opts; }
bool CheckpointManager::due(int64_t step) const {
  return enabled() && impl_->core->opts.every_steps > 0 && step % impl_->core->opts.every_steps == 0;
}

bool CheckpointManager::wait() {
  impl_->lastError.clear();
  return enabled() ? impl_->finishPending() : true;
}

const std::string& CheckpointManager::lastError() const { return impl_->lastError; }

void CheckpointManager::noteAnswerTeacher(uint64_t fingerprint) {
  auto& s = *impl_;
  if (fingerprint == 0) return;
  s.core->answerTeacher.store(fingerprint);
  if (s.resumedTeacher == 0 || s.teacherChecked || fingerprint == s.resumedTeacher) return;
  s.teacherChecked = true;
  DISTILL_LOG(kWarning) << "checkpoint: the model resumed was trained on the answers of teacher " << std::hex
                        << s.resumedTeacher << ", this run's teacher answers as " << fingerprint << std::dec
                        << " (other weights or another head): training goes on with this run's teacher";
}

uint64_t CheckpointManager::resumedAnswerTeacher() const { return impl_->resumedTeacher; }

bool CheckpointManager::save(int64_t step, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                             const TrainState& train, const RankState& rank, std::mt19937_64* rng) {
  ModelRef ref;
  ref.model = &model;
  ref.optimizer = &optimizer;
  return saveRef(step, ref, train, rank, rng);
}

bool CheckpointManager::saveBytes(int64_t step, std::string modelBytes, std::string optimizerBytes,
                                  const TrainState& train, const RankState& rank, bool cuda) {
  ModelRef ref;
  ref.modelBytes = &modelBytes;
  ref.optimizerBytes = &optimizerBytes;
  ref.cuda = cuda;
  return saveRef(step, ref, train, rank, nullptr);
}

bool CheckpointManager::saveRef(int64_t step, const ModelRef& state, const TrainState& train, const RankState& rank,
                                std::mt19937_64* rng) {
  auto& s = *impl_;
  CheckpointCore& c = *s.core;
  s.lastError.clear();
  if (!enabled()) return false;
  DISTILL_CHECK_T(CheckpointError, step >= 0, "checkpoint step must be >= 0, got ", step);
  trace::Scope recorded(checkpointEvent("save", step)); // the hang table shows a stuck save
  bool previousOk = s.finishPending();
  const std::string tmpDir = c.path(stepName(step) + ".tmp");
  auto start = Clock::now();
  std::vector<OutFile> files;
  std::string snapError;
  try {
    files = c.snapshot(step, state, train, rank, rng);
  } catch (const std::exception& e) {
    snapError = "cannot serialize the state: " + messageOf(e);
  }
  if (!c.opts.async) {
    bool ok = s.saveSync(step, tmpDir, files, snapError);
    DISTILL_LOG(kDebug) << "checkpoint step " << step << ": save took " << toMs(Clock::now() - start) << " ms";
    return ok && previousOk;
  }
  // Async: the writer does file I/O and notes only, and publishes by itself
  // once every rank's files are durable; the next save()/wait()/loadLatest()
  // reports the outcome, and the destructor waits for it.
  auto result = std::make_shared<AsyncResult>();
  s.pending = Impl::Pending{step, tmpDir, result};
  const int64_t seq = ++s.saveSeq;
  if (!s.writer->waitIdle(Deadline::after(s.writerPatience()))) {
    result->error = "the background writer is still busy with an abandoned checkpoint after " +
        std::to_string(s.writerPatience().count()) + " ms";
    return previousOk;
  }
  auto core = s.core;
  auto task = [core, seq, step, tmpDir, snapError, result, files = std::move(files)]() mutable {
    try {
      core->runAsync(seq, step, tmpDir, files, snapError, *result);
    } catch (const std::exception& e) {
      result->ok = false;
      result->error = messageOf(e);
    } catch (...) {
      result->ok = false;
      result->error = "unknown error writing " + tmpDir;
    }
  };
  {
    std::lock_guard<std::mutex> lock(s.writer->mu);
    DISTILL_INTERNAL_ASSERT(!s.writer->busy, "a second async checkpoint in flight");
    s.writer->task = std::move(task);
    s.writer->busy = true;
    s.writer->cv.notify_all();
  }
  DISTILL_LOG(kDebug) << "checkpoint step " << step << ": snapshot took " << toMs(Clock::now() - start)
                      << " ms, writing in the background";
  return previousOk;
}

std::optional<LoadedState> CheckpointManager::loadLatest(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                                         std::mt19937_64* rng) {
  ModelRef ref;
  ref.model = &model;
  ref.optimizer = &optimizer;
  return loadRef(ref, rng);
}

std::optional<LoadedState> CheckpointManager::loadLatestBytes(std::string& modelBytes, std::string& optimizerBytes,
                                                              bool cuda) {
  ModelRef ref;
  ref.modelBytes = &modelBytes;
  ref.optimizerBytes = &optimizerBytes;
  ref.cuda = cuda;
  return loadRef(ref, nullptr);
}

std::optional<LoadedState> CheckpointManager::loadRef(const ModelRef& state, std::mt19937_64* rng) {
  auto& s = *impl_;
  CheckpointCore& c = *s.core;
  if (!enabled()) return std::nullopt;
  trace::Scope recorded(checkpointEvent("load", -1));
  s.finishPending();
  // Rank 0 chooses; [status (0 none, 1 found, 2 error), step, saved world size, answer teacher's bits].
  auto choice = torch::zeros({4}, torch::kLong);
  std::string err;
  std::optional<Manifest> chosen;
  if (c.rank == 0) {
    try {
      chosen = c.choose();
      if (chosen) {
        choice = torch::tensor({int64_t{1}, chosen->step, int64_t{chosen->studentWorldSize},
                                static_cast<int64_t>(chosen->answerTeacher)});
      }
    } catch (const std::exception& e) {
      err = messageOf(e);
      choice[0] = 2;
    }
  }
  s.group->broadcast(choice, 0, "checkpoint load: choice");
  const int64_t status = choice[0].item<int64_t>(), step = choice[1].item<int64_t>();
  const int64_t savedWorld = choice[2].item<int64_t>();
  s.resumedTeacher = static_cast<uint64_t>(choice[3].item<int64_t>());
  s.teacherChecked = false;
  if (status == 2) { // every rank throws rank 0's reason
    err = broadcastText(*s.group, err, 0, "checkpoint load: why not");
    DISTILL_THROW(CheckpointError, "checkpoint load: ", err);
  }
  if (status == 0) {
    DISTILL_LOG(kInfo) << "checkpoint: no checkpoint to load in " << c.opts.dir << ": clean start";
    return std::nullopt;
  }
  const std::string dir = c.path(stepName(step));
  DISTILL_CHECK_T(CheckpointError, savedWorld == c.world, "checkpoint ", dir, " was saved by ", savedWorld,
                  " student ranks, this run has ", c.world,
                  ": per-rank state (RNG, data position) cannot be re-split over a different number of "
                  "ranks; resume with ",
                  savedWorld, " students or start from a fresh checkpoint.dir");
  if (chosen) {
    if (chosen->configHash != c.cfgHash) {
      DISTILL_LOG(kWarning) << "checkpoint " << dir << " was saved under another config: " << c.configChange(*chosen)
                            << "; resuming from it all the same";
    }
    if (chosen->teacherFingerprint != c.fingerprint) {
      DISTILL_LOG(kWarning) << "checkpoint " << dir << " was saved with teacher \"" << chosen->teacherFingerprint
                            << "\", this run has \"" << c.fingerprint << "\"";
    }
  }
  std::optional<LoadedState> out;
  try {
    out = c.loadStep(step, state, rng);
  } catch (const std::exception& e) {
    err = messageOf(e);
  }
  auto failed = torch::zeros({c.world}, torch::kLong);
  failed[c.rank] = err.empty() ? 0 : 1;
  s.group->allReduce(failed, ReduceOp::kSum, "checkpoint load: step " + std::to_string(step));
  std::vector<int> bad;
  for (int r = 0; r < c.world; ++r) {
    if (failed[r].item<int64_t>() != 0) bad.push_back(r);
  }
  DISTILL_CHECK_T(CheckpointError, bad.empty(), "checkpoint load of ", dir, " failed: ",
                  err.empty() ? "student rank(s) " + join(bad) + " could not load it (their logs say why)" : err);
  DISTILL_LOG(kInfo) << "checkpoint: resumed from " << dir << " (train step " << out->train.step << ")";
  return out;
}

} // namespace distill
