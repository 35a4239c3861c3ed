#pragma once

// What the checkpoint manager's files share (internal to ckpt/src):
//   checkpoint_impl.h      helpers, a save's files and verdict, CheckpointCore (declared)
//   archive.h              torch archives: to and from bytes, a module's deep copy
//   async_writer.h         the async manager's background writer and its result
//   checkpoint_publish.cpp a save's outcome across ranks: decide, make room, publish, prune
//   checkpoint_files.cpp   a rank's files: snapshot for a save, choose and read for a load
//   checkpoint.cpp         CheckpointManager: the calls of checkpoint.h

#include "distill/ckpt/checkpoint.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "distill/core/checksum.h"
#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/group/student_context.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/strings.h"
#include "distill/group/student_group.h"
#include "distill/core/trace.h"
#include "archive.h"
#include "async_writer.h"
#include "layout.h"

namespace distill::ckpt_impl {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;
using namespace ckpt_layout;

constexpr int64_t kRankFormat = 1;

inline std::string messageOf(const std::exception& e) {
  if (auto de = dynamic_cast<const Error*>(&e)) return de->message();
  return e.what();
}

// Rank `root`'s `text` on every rank (two broadcasts; for error paths).
inline std::string broadcastText(StudentGroup& group, const std::string& text, int root, const std::string& what) {
  auto len = torch::full({1}, static_cast<int64_t>(text.size()), torch::kLong);
  group.broadcast(len, root, what + " (length)");
  auto bytes = torch::zeros({len.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() > 0) group.broadcast(bytes, root, what);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

// What model.pt and optimizer.pt hold: a Module and an Optimizer (the C++
// API), or bytes the trainer serialized itself (the Python binding: torch.save
// of the state dicts), read back into the same strings on load.
struct ModelRef {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  std::string* modelBytes = nullptr; // used when model is null
  std::string* optimizerBytes = nullptr; // used when optimizer is null
  bool cuda = false; // bytes: the trainer's model is on a GPU (its generators are saved too)
  std::optional<torch::Device> device() const {
    if (model) return deviceOf(*model);
    return cuda ? std::optional<torch::Device>(torch::Device(torch::kCUDA)) : std::nullopt;
  }
};

// One file of a checkpoint: bytes ready, or an archive serialized when written.
struct OutFile {
  std::string name;
  std::string bytes;
  std::shared_ptr<OutputArchive> archive;
};

// What writing this rank's files of a checkpoint gave.
struct WriteResult {
  std::string error; // "" when every file is written and fsynced
  bool noSpace = false; // the error was ENOSPC or EDQUOT
  std::vector<ManifestFile> files; // name, size, CRC32C of each
};

// Creates `dir` and writes `files` into it, each fsynced. An archive is
// serialized once and its bytes kept (as the others' are): a write retried
// after making room writes the same bytes again.
inline WriteResult writeFiles(FileSystem& fs, const std::string& dir, std::vector<OutFile>& files) {
  WriteResult r;
  try {
    fs.createDirs(dir);
    for (auto& f : files) {
      if (f.archive) {
        f.bytes = toBytes(*f.archive);
        f.archive.reset();
      }
      fs.writeFile(dir + "/" + f.name, f.bytes);
      r.files.push_back({f.name, static_cast<int64_t>(f.bytes.size()), crc32c(f.bytes.data(), f.bytes.size())});
    }
  } catch (const FileSystemError& e) {
    r.error = e.message();
    r.noSpace = e.noSpace();
  } catch (const std::exception& e) {
    r.error = messageOf(e);
  }
  return r;
}

// How one rank's files of a save attempt went, as student rank 0 learns it.
struct RankReport {
  enum State { kWritten, kFailed, kMissing } state = kMissing;
  bool noSpace = false;
  int64_t size = 0;
  uint32_t crc = 0;
};

// The outcome of one save attempt. Student rank 0 decides it and every rank
// learns it (a broadcast in sync mode, a note in async mode), so that every
// rank reports the same.
struct Verdict {
  enum Code : int64_t { kPublished = 0, kRetry = 1, kFailed = 2 };
  int64_t code = kFailed;
  std::vector<int> failed; // ranks whose files could not be written
  std::vector<int> missing; // ranks that never reported theirs (async)
  bool publishFailed = false; // student rank 0 could not publish
  bool full = false; // out of space, nothing more to remove this time
  int64_t kept = -1; // the published checkpoint left in place; -1 none, -2 unknown

  std::string encode() const {
    return nlohmann::json{{"code", code}, {"failed", failed}, {"missing", missing}, {"publish_failed", publishFailed},
                          {"full", full}, {"kept", kept}}
        .dump();
  }
  // Throws (nlohmann) on anything else than encode() wrote.
  static Verdict decode(const std::string& s) {
    auto j = nlohmann::json::parse(s);
    Verdict v;
    v.code = j.at("code").get<int64_t>();
    v.failed = j.at("failed").get<std::vector<int>>();
    v.missing = j.at("missing").get<std::vector<int>>();
    v.publishFailed = j.at("publish_failed").get<bool>();
    v.full = j.at("full").get<bool>();
    v.kept = j.at("kept").get<int64_t>();
    return v;
  }
};

// The flight recorder's event for a save (at `step`) or a load (step < 0).
inline trace::Event checkpointEvent(const char* what, int64_t step) {
  trace::Event e;
  e.op = trace::Op::kCheckpoint;
  e.label = what;
  e.step = step;
  e.accStep = 0;
  if (step < 0) trace::currentStep(&e.step, &e.accStep);
  return e;
}

// The checkpoint directory and what is done in it: shared by the caller's
// thread and the background writer (which holds it, so that a writer
// abandoned past every deadline never outlives it). Apart from `notes`, only
// one thread at a time uses it: the caller's thread waits for the writer to be
// idle before it does anything here.
struct CheckpointCore {
  CheckpointOptions opts;
  std::string fingerprint;
  // noteAnswerTeacher's last (the caller's thread writes, the writer reads it at publication).
  std::atomic<uint64_t> answerTeacher{0};
  std::shared_ptr<FileSystem> fs;
  uint64_t cfgHash = 0;
  Config config; // this run's
  std::string configYaml; // dumpConfig(config): each checkpoint's config.yaml
  int rank = 0;
  int world = 1;
  Millis timeout{0};
  std::shared_ptr<GroupNotes> notes; // async: the writers' channel (its own store connection)

  std::string path(const std::string& name) const { return opts.dir + "/" + name; }

  // The step `latest` names, if it names an existing step_N/; -1 otherwise.
  int64_t committedStep();

  // The published checkpoint that a failed save leaves in place: the one
  // `latest` names, or (no `latest`) the newest complete one; -1 when there is
  // none; -2 when the directory cannot be read.
  int64_t keptStep();

  // Rank 0, after writing `step` failed for want of space. Removes every
  // partial step_N.tmp/ but `step`'s own, every uncommitted step_N/ (newer
  // than `latest`), and the oldest complete checkpoint older than `step` —
  // never the one loadLatest would take now (the one `latest` names; without
  // `latest`, the newest). keep_last is a most, not a least: when space runs
  // out, older checkpoints go first, the newest only once a newer one is
  // published. Returns the names removed.
  std::vector<std::string> makeRoom(int64_t step);

  // Rank 0, once `latest` names `step`: removes every step_N.tmp/, every
  // step_N/ newer than `step` (never loadable now), and all but the
  // keep_last-1 newest older ones. Failures are warnings.
  void prune(int64_t step);

  // Rank 0, once every rank's files of `step` are durable: manifest, rename,
  // `latest` (the commit point), prune.
  void publish(int64_t step, const std::string& tmpDir, const WriteResult& mine,
               const std::vector<RankReport>& reports);

  // Rank 0: what becomes of attempt `attempt` of `step`, given every rank's
  // report (its own in `mine`). Publishes when all are written; when some
  // failed for want of space only and this is the first attempt, makes room
  // and says retry. `*publishError` gets rank 0's reason when publishing failed.
  Verdict decide(int64_t step, int attempt, const std::string& tmpDir, const WriteResult& mine,
                 const std::vector<RankReport>& reports, std::string* publishError);

  // Why a save failed, as this rank words it (after "checkpoint step N not
  // saved: "). `mine`: this rank's own failure ("" if its part went well).
  std::string failureText(const Verdict& v, const std::string& mine) const;

  // Rank 0, best effort, once no rank writes into tmpDir any more.
  void removeTmp(const std::string& tmpDir);

  // An async save, on the writer thread: file I/O and notes only. Each rank
  // writes its files and posts a note (written, or failed and whether for want
  // of space); student rank 0 awaits every note, decides (publishes when all
  // are written), posts the verdict, and waits for every rank to have read it
  // (the store lives in its process) before it goes idle. On a retry verdict
  // every rank writes its files again, once.
  void runAsync(int64_t seq, int64_t step, const std::string& tmpDir, std::vector<OutFile>& files,
                const std::string& snapError, AsyncResult& out);

  // The files of this rank for `step`. Async: every tensor is a CPU copy taken
  // now (optimizer state is serialized now: torch's Optimizer API offers no
  // deep copy), so training may go on while the writer works.
  std::vector<OutFile> snapshot(int64_t step, const ModelRef& state, const TrainState& train, const RankState& rs,
                                std::mt19937_64* rng);

  // Rank 0: the checkpoint to load (scanCheckpoints), with a warning for each
  // one passed over. Every candidate corrupt: a CheckpointError naming each
  // (on_corrupt=error) or a warning and a clean start (restart).
  std::optional<Manifest> choose();

  // Rank 0: how the config checkpoint `m` was saved under differs from this
  // run's, in training keys (the only ones its config hash covers).
  std::string configChange(const Manifest& m);

  // Reads `name` of checkpoint `dir`, checking it against the manifest.
  std::string readVerified(const std::string& dir, const Manifest& m, const std::string& name);

  LoadedState loadStep(int64_t step, const ModelRef& state, std::mt19937_64* rng);
};

} // namespace distill::ckpt_impl
