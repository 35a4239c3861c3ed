#include "distill/ckpt/checkpoint.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/context.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/strings.h"
#include "distill/core/student_group.h"
#include "distill/core/trace.h"
#include "layout.h"

namespace distill {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;
using namespace ckpt_layout;

constexpr int64_t kRankFormat = 1;

std::string messageOf(const std::exception& e) {
  if (auto de = dynamic_cast<const Error*>(&e)) return de->message();
  return e.what();
}

// Rank `root`'s `text` on every rank (two broadcasts; for error paths).
std::string broadcastText(StudentGroup& group, const std::string& text, int root, const std::string& what) {
  auto len = torch::full({1}, static_cast<int64_t>(text.size()), torch::kLong);
  group.broadcast(len, root, what + " (length)");
  auto bytes = torch::zeros({len.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() > 0) group.broadcast(bytes, root, what);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

std::string toBytes(OutputArchive& a) {
  std::string out;
  a.save_to([&](const void* p, size_t n) {
    out.append(static_cast<const char*>(p), n);
    return n;
  });
  return out;
}

at::Tensor bytesTensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string tensorBytes(const at::Tensor& t) {
  auto c = t.to(torch::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

int64_t readInt(InputArchive& a, const std::string& key) {
  c10::IValue v;
  a.read(key, v);
  return v.toInt();
}

at::Tensor readTensor(InputArchive& a, const std::string& key) {
  at::Tensor t;
  a.read(key, t, /*is_buffer=*/true);
  return t;
}

// Deep copy of a module's parameters and buffers to CPU, laid out as
// Module::save lays them out, so that Module::load reads it back.
void snapshotModule(const torch::nn::Module& m, OutputArchive& a) {
  torch::NoGradGuard noGrad;
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    a.write(p.key(), p.value().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
  for (const auto& b : m.named_buffers(/*recurse=*/false)) {
    a.write(b.key(), b.value().detach().to(torch::kCPU, false, true), /*is_buffer=*/true);
  }
  for (const auto& c : m.named_children()) {
    if (!c.value()->is_serializable()) continue;
    OutputArchive child(a.compilation_unit());
    snapshotModule(*c.value(), child);
    a.write(c.key(), child);
  }
}

std::optional<torch::Device> deviceOf(const torch::nn::Module& m) {
  auto params = m.parameters();
  if (params.empty()) return std::nullopt;
  return params.front().device();
}

at::Generator cpuGenerator() { return at::detail::getDefaultCPUGenerator(); }

// One file of a checkpoint: bytes ready, or an archive serialized when written.
struct OutFile {
  std::string name;
  std::string bytes;
  std::shared_ptr<OutputArchive> archive;
};

// What writing this rank's files of a checkpoint gave.
struct WriteResult {
  std::string error;                // "" when every file is written and fsynced
  bool noSpace = false;             // the error was ENOSPC or EDQUOT
  std::vector<ManifestFile> files;  // name, size, CRC32C of each
};

// Creates `dir` and writes `files` into it, each fsynced. An archive is
// serialized once and its bytes kept (as the others' are): a write retried
// after making room writes the same bytes again.
WriteResult writeFiles(FileSystem& fs, const std::string& dir, std::vector<OutFile>& files) {
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
  std::vector<int> failed;     // ranks whose files could not be written
  std::vector<int> missing;    // ranks that never reported theirs (async)
  bool publishFailed = false;  // student rank 0 could not publish
  bool full = false;           // out of space, nothing more to remove this time
  int64_t kept = -1;           // the published checkpoint left in place; -1 none, -2 unknown

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

// The single background writer of an async manager. Its state is shared with
// the thread, so that a thread stuck in I/O past every deadline can be detached.
// It runs file I/O and notes (GroupNotes), never a collective.
struct Writer {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> task;  // set by the caller thread, cleared by the writer
  bool busy = false;           // a task is queued or running
  bool stop = false;

  static void loop(std::shared_ptr<Writer> w) {
    std::unique_lock<std::mutex> lock(w->mu);
    for (;;) {
      w->cv.wait(lock, [&] { return w->stop || w->task; });
      if (!w->task) return;
      auto task = std::move(w->task);
      w->task = nullptr;
      lock.unlock();
      task();  // catches everything itself
      lock.lock();
      w->busy = false;
      w->cv.notify_all();
    }
  }
  // Waits until no task is queued or running; false if the deadline passed first.
  bool waitIdle(Deadline d) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_until(lock, d.when(), [&] { return !busy; });
  }
};

// The flight recorder's event for a save (at `step`) or a load (step < 0).
trace::Event checkpointEvent(const char* what, int64_t step) {
  trace::Event e;
  e.op = trace::Op::kCheckpoint;
  e.label = what;
  e.step = step;
  e.accStep = 0;
  if (step < 0) currentStep(&e.step, &e.accStep);
  return e;
}

// What an async save leaves for the caller's thread: set by the writer before
// it goes idle (the writer's mutex orders it before waitIdle returns).
struct AsyncResult {
  bool ok = false;
  std::string error;  // the reason, as failSave words it after "not saved: "
};

// The checkpoint directory and what is done in it: shared by the caller's
// thread and the background writer (which holds it, so that a writer
// abandoned past every deadline never outlives it). Apart from `notes`, only
// one thread at a time uses it: the caller's thread waits for the writer to be
// idle before it does anything here.
struct CheckpointCore {
  CheckpointOptions opts;
  std::string fingerprint;
  std::shared_ptr<FileSystem> fs;
  uint64_t cfgHash = 0;
  Config config;           // this run's
  std::string configYaml;  // dumpConfig(config): each checkpoint's config.yaml
  int rank = 0;
  int world = 1;
  Millis timeout{0};
  std::shared_ptr<GroupNotes> notes;  // async: the writers' channel (its own store connection)

  std::string path(const std::string& name) const { return opts.dir + "/" + name; }

  // The step `latest` names, if it names an existing step_N/; -1 otherwise.
  int64_t committedStep() {
    const std::string p = path(kLatest);
    if (!fs->exists(p)) return -1;
    std::string text = fs->readFile(p);
    if (!text.empty() && text.back() == '\n') text.pop_back();
    bool tmp = false;
    const int64_t s = parseStepName(text, &tmp);
    return s >= 0 && !tmp && fs->exists(path(stepName(s))) ? s : -1;
  }

  // The published checkpoint that a failed save leaves in place: the one
  // `latest` names, or (no `latest`) the newest complete one; -1 when there is
  // none; -2 when the directory cannot be read.
  int64_t keptStep() {
    try {
      int64_t s = committedStep();
      if (s >= 0) return s;
      for (const auto& name : fs->list(opts.dir)) {
        bool tmp = false;
        const int64_t n = parseStepName(name, &tmp);
        if (n >= 0 && !tmp) s = std::max(s, n);
      }
      return s;
    } catch (const std::exception&) {
      return -2;
    }
  }

  // Rank 0, after writing `step` failed for want of space. Removes every
  // partial step_N.tmp/ but `step`'s own, every uncommitted step_N/ (newer
  // than `latest`), and the oldest complete checkpoint older than `step` —
  // never the one loadLatest would take now (the one `latest` names; without
  // `latest`, the newest). keep_last is a most, not a least: when space runs
  // out, older checkpoints go first, the newest only once a newer one is
  // published. Returns the names removed.
  std::vector<std::string> makeRoom(int64_t step) {
    const int64_t committed = committedStep();
    std::vector<std::string> out;
    std::vector<int64_t> older;
    int64_t newest = -1;
    for (const auto& name : fs->list(opts.dir)) {
      bool tmp = false;
      const int64_t s = parseStepName(name, &tmp);
      if (s < 0) continue;
      if (tmp) {
        if (s != step) out.push_back(name);
      } else if (committed >= 0 && s > committed) {
        out.push_back(name);
      } else {
        newest = std::max(newest, s);
        if (s < step) older.push_back(s);
      }
    }
    const int64_t keep = committed >= 0 ? committed : newest;
    std::sort(older.begin(), older.end());
    for (int64_t s : older) {
      if (s != keep) {
        out.push_back(stepName(s));
        break;
      }
    }
    for (const auto& name : out) fs->removeAll(path(name));
    return out;
  }

  // Rank 0, once `latest` names `step`: removes every step_N.tmp/, every
  // step_N/ newer than `step` (never loadable now), and all but the
  // keep_last-1 newest older ones. Failures are warnings.
  void prune(int64_t step) {
    try {
      std::vector<int64_t> older;
      for (const auto& name : fs->list(opts.dir)) {
        bool tmp = false;
        const int64_t s = parseStepName(name, &tmp);
        if (s < 0 || (s == step && !tmp)) continue;
        if (tmp) {
          fs->removeAll(path(name));
        } else if (s > step) {
          DISTILL_LOG(kWarning) << "checkpoint: removing " << path(name) << ": newer than step " << step
                                << ", which `latest` now names, so it can never be loaded";
          fs->removeAll(path(name));
        } else {
          older.push_back(s);
        }
      }
      std::sort(older.rbegin(), older.rend());
      for (size_t i = static_cast<size_t>(std::max(0, opts.keep_last - 1)); i < older.size(); ++i) {
        fs->removeAll(path(stepName(older[i])));
      }
    } catch (const std::exception& e) {
      DISTILL_LOG(kWarning) << "checkpoint: pruning old checkpoints in " << opts.dir << " failed: " << messageOf(e);
    }
  }

  // Rank 0, once every rank's files of `step` are durable: manifest, rename,
  // `latest` (the commit point), prune.
  void publish(int64_t step, const std::string& tmpDir, const WriteResult& mine,
               const std::vector<RankReport>& reports) {
    auto start = Clock::now();
    Manifest m;
    m.step = step;
    m.studentWorldSize = world;
    m.configHash = cfgHash;
    m.teacherFingerprint = fingerprint;
    for (const auto& f : mine.files) {
      if (f.name.rfind("rank_", 0) != 0) m.files.push_back(f);
    }
    int64_t total = 0;
    for (int r = 0; r < world; ++r) m.files.push_back({rankFile(r), reports[r].size, reports[r].crc});
    for (const auto& f : m.files) total += f.size;
    // A step_N.tmp left by an interrupted earlier attempt may hold strays.
    for (const auto& name : fs->list(tmpDir)) {
      if (!m.find(name)) fs->removeAll(tmpDir + "/" + name);
    }
    fs->writeFile(tmpDir + "/" + kManifest, formatManifest(m));
    fs->syncDir(tmpDir);
    const std::string final = path(stepName(step));
    if (fs->exists(final)) {
      DISTILL_LOG(kWarning) << "checkpoint: replacing existing " << final;
      fs->removeAll(final);
    }
    fs->rename(tmpDir, final);
    fs->syncDir(opts.dir);
    // The commit point (layout.h): from here on loadLatest takes this one.
    fs->writeFile(path("latest.tmp"), stepName(step) + "\n");
    fs->rename(path("latest.tmp"), path(kLatest));
    fs->syncDir(opts.dir);
    DISTILL_LOG(kInfo) << "checkpoint step " << step << " published: " << final << " (" << m.files.size()
                       << " files, " << total << " bytes, publish " << toMs(Clock::now() - start) << " ms)";
    prune(step);
  }

  // Rank 0: what becomes of attempt `attempt` of `step`, given every rank's
  // report (its own in `mine`). Publishes when all are written; when some
  // failed for want of space only and this is the first attempt, makes room
  // and says retry. `*publishError` gets rank 0's reason when publishing failed.
  Verdict decide(int64_t step, int attempt, const std::string& tmpDir, const WriteResult& mine,
                 const std::vector<RankReport>& reports, std::string* publishError) {
    Verdict v;
    bool allNoSpace = true;
    for (int r = 0; r < world; ++r) {
      if (reports[r].state == RankReport::kFailed) {
        v.failed.push_back(r);
        allNoSpace = allNoSpace && reports[r].noSpace;
      } else if (reports[r].state == RankReport::kMissing) {
        v.missing.push_back(r);
      }
    }
    if (v.failed.empty() && v.missing.empty()) {
      try {
        publish(step, tmpDir, mine, reports);
        v.code = Verdict::kPublished;
        return v;
      } catch (const std::exception& e) {
        *publishError = messageOf(e);
        v.publishFailed = true;
      }
    } else if (v.missing.empty() && allNoSpace) {
      std::vector<std::string> removed;
      if (attempt == 0) {
        try {
          removed = makeRoom(step);
        } catch (const std::exception& e) {
          DISTILL_LOG(kWarning) << "checkpoint step " << step << ": could not make room in " << opts.dir << ": "
                                << messageOf(e);
        }
      }
      if (!removed.empty()) {
        std::string names;
        for (const auto& n : removed) names += (names.empty() ? "" : ", ") + n;
        DISTILL_LOG(kWarning) << "checkpoint step " << step << ": no space left in " << opts.dir << "; removed "
                              << names << " to make room (never the newest checkpoint) and writing it again";
        v.code = Verdict::kRetry;
        return v;
      }
      v.full = true;
    }
    v.code = Verdict::kFailed;
    v.kept = keptStep();
    return v;
  }

  // Why a save failed, as this rank words it (after "checkpoint step N not
  // saved: "). `mine`: this rank's own failure ("" if its part went well).
  std::string failureText(const Verdict& v, const std::string& mine) const {
    std::string err;
    if (!mine.empty()) {
      err = mine;
      if (v.failed.size() > 1) err += " (student rank(s) " + join(v.failed) + " failed)";
    } else if (v.publishFailed) {
      err = "student rank 0 could not publish it (its log says why)";
    } else if (!v.failed.empty()) {
      err = "student rank(s) " + join(v.failed) + " could not write their state (their logs say why)";
    }
    if (!v.missing.empty()) {
      err += std::string(err.empty() ? "" : "; ") + "student rank(s) " + join(v.missing) +
             " never reported their files within " + std::to_string(timeout.count()) +
             " ms (run.collective_timeout_s)";
    }
    if (v.full) {
      err += "; " + opts.dir + " is out of space: to make room distill removes partial checkpoints and the "
             "oldest complete one (once per save), never the newest before a newer one is published, so "
             "checkpoint.dir needs room for at least two checkpoints";
    }
    if (v.kept >= 0) {
      err += "; the newest checkpoint, " + path(stepName(v.kept)) + ", is left as it was";
    } else if (v.kept == -1) {
      err += "; there is no earlier checkpoint in " + opts.dir;
    } else {
      err += "; the earlier checkpoints in " + opts.dir + " are left as they were";
    }
    return err;
  }

  // Rank 0, best effort, once no rank writes into tmpDir any more.
  void removeTmp(const std::string& tmpDir) {
    try {
      fs->removeAll(tmpDir);
    } catch (const std::exception& e) {
      DISTILL_LOG(kWarning) << "checkpoint: could not remove " << tmpDir << ": " << messageOf(e);
    }
  }

  // An async save, on the writer thread: file I/O and notes only. Each rank
  // writes its files and posts a note (written, or failed and whether for want
  // of space); student rank 0 awaits every note, decides (publishes when all
  // are written), posts the verdict, and waits for every rank to have read it
  // (the store lives in its process) before it goes idle. On a retry verdict
  // every rank writes its files again, once.
  void runAsync(int64_t seq, int64_t step, const std::string& tmpDir, std::vector<OutFile>& files,
                const std::string& snapError, AsyncResult& out) {
    auto key = [&](int attempt, const std::string& who) {
      return "s" + std::to_string(seq) + "/a" + std::to_string(attempt) + "/" + who;
    };
    std::vector<std::string> used;  // rank 0 removes these at the end
    for (int attempt = 0; attempt < 2; ++attempt) {
      WriteResult mine;
      if (snapError.empty()) {
        mine = writeFiles(*fs, tmpDir, files);
      } else {
        mine.error = snapError;
      }
      const ManifestFile* own = nullptr;
      for (const auto& f : mine.files) {
        if (f.name == rankFile(rank)) own = &f;
      }
      const bool written = mine.error.empty() && own;
      if (rank != 0) {
        nlohmann::json note{{"written", written}, {"no_space", mine.noSpace}, {"size", written ? own->size : 0},
                            {"crc32c", written ? own->crc32c : 0}};
        notes->post(key(attempt, "r" + std::to_string(rank)), note.dump());
        const Millis patience = 2 * timeout;  // rank 0's own writing, then its wait for every note
        auto got = notes->await({key(attempt, "verdict")}, patience);
        if (!got[0]) {
          out.error = "no verdict from student rank 0 within " + std::to_string(patience.count()) +
                      " ms (2 x run.collective_timeout_s; awaited: its publication of " + tmpDir + ")";
          return;
        }
        Verdict v = Verdict::decode(*got[0]);
        if (v.code == Verdict::kRetry) continue;
        notes->post(key(attempt, "ack" + std::to_string(rank)), "1");
        out.ok = v.code == Verdict::kPublished;
        if (!out.ok) out.error = failureText(v, mine.error);
        return;
      }
      std::vector<RankReport> reports(world);
      reports[0].state = written ? RankReport::kWritten : RankReport::kFailed;
      reports[0].noSpace = mine.noSpace;
      if (written) {
        reports[0].size = own->size;
        reports[0].crc = own->crc32c;
      }
      std::vector<std::string> keys;
      for (int r = 1; r < world; ++r) keys.push_back(key(attempt, "r" + std::to_string(r)));
      auto got = notes->await(keys, timeout);
      std::vector<std::string> acks;
      for (int r = 1; r < world; ++r) {
        const auto& note = got[r - 1];
        if (!note) continue;  // kMissing
        used.push_back(keys[r - 1]);
        auto j = nlohmann::json::parse(*note);
        auto& rep = reports[r];
        rep.state = j.at("written").get<bool>() ? RankReport::kWritten : RankReport::kFailed;
        rep.noSpace = j.at("no_space").get<bool>();
        rep.size = j.at("size").get<int64_t>();
        rep.crc = j.at("crc32c").get<uint32_t>();
        acks.push_back(key(attempt, "ack" + std::to_string(r)));
      }
      std::string publishError;
      Verdict v = decide(step, attempt, tmpDir, mine, reports, &publishError);
      notes->post(key(attempt, "verdict"), v.encode());
      used.push_back(key(attempt, "verdict"));
      if (v.code == Verdict::kRetry) continue;
      auto acked = notes->await(acks, timeout);
      for (size_t i = 0; i < acks.size(); ++i) {
        if (acked[i]) used.push_back(acks[i]);
      }
      for (const auto& k : used) notes->erase(k);
      out.ok = v.code == Verdict::kPublished;
      if (!out.ok) {
        if (v.missing.empty()) removeTmp(tmpDir);  // nobody writes there any more
        out.error = failureText(v, mine.error.empty() ? publishError : mine.error);
      }
      return;
    }
    DISTILL_INTERNAL_ASSERT(false, "checkpoint step ", step, ": a retry verdict after the retry");
  }

  // The files of this rank for `step`. Async: every tensor is a CPU copy taken
  // now (optimizer state is serialized now: torch's Optimizer API offers no
  // deep copy), so training may go on while the writer works.
  std::vector<OutFile> snapshot(int64_t step, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                const TrainState& train, const RankState& rs, std::mt19937_64* rng) {
    torch::NoGradGuard noGrad;
    std::vector<OutFile> files;
    OutFile rf{rankFile(rank), {}, std::make_shared<OutputArchive>()};
    auto& a = *rf.archive;
    a.write("format", c10::IValue(kRankFormat));
    a.write("step", c10::IValue(step));
    a.write("rank", c10::IValue(static_cast<int64_t>(rank)));
    a.write("world_size", c10::IValue(static_cast<int64_t>(world)));
    {
      auto gen = cpuGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      a.write("rng_cpu", gen.get_state(), true);
    }
    int64_t cudaGens = 0;
    auto dev = deviceOf(model);
    if (dev && dev->is_cuda()) {
      cudaGens = static_cast<int64_t>(at::getNumGPUs());
      for (int64_t i = 0; i < cudaGens; ++i) {
        auto gen = at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, static_cast<int>(i)));
        std::lock_guard<std::mutex> lock(gen.mutex());
        a.write("rng_cuda_" + std::to_string(i), gen.get_state(), true);
      }
    }
    a.write("rng_cuda_count", c10::IValue(cudaGens));
    std::string mt;
    if (rng) {
      std::ostringstream os;
      os << *rng;
      mt = os.str();
    }
    a.write("has_mt19937_64", c10::IValue(static_cast<int64_t>(rng != nullptr)));
    a.write("mt19937_64", bytesTensor(mt), true);
    a.write("data_epoch", c10::IValue(rs.data.epoch));
    a.write("data_index", c10::IValue(rs.data.index));
    a.write("extra", bytesTensor(rs.extra), true);
    files.push_back(std::move(rf));
    if (rank != 0) return files;

    OutFile mf{kModel, {}, std::make_shared<OutputArchive>()};
    if (opts.async) {
      snapshotModule(model, *mf.archive);
    } else {
      model.save(*mf.archive);
    }
    files.push_back(std::move(mf));
    OutputArchive oa;
    optimizer.save(oa);
    files.push_back({kOptimizer, toBytes(oa), nullptr});
    OutputArchive ta;
    ta.write("step", c10::IValue(train.step));
    ta.write("acc_step", c10::IValue(train.accStep));
    ta.write("tokens_seen", c10::IValue(train.tokensSeen));
    ta.write("data_epoch", c10::IValue(train.data.epoch));
    ta.write("data_index", c10::IValue(train.data.index));
    ta.write("extra", bytesTensor(train.extra), true);
    files.push_back({kTrain, toBytes(ta), nullptr});
    files.push_back({kConfig, configYaml, nullptr});
    return files;
  }

  // Rank 0: the checkpoint to load (scanCheckpoints), with a warning for each
  // one passed over. Every candidate corrupt: a CheckpointError naming each
  // (on_corrupt=error) or a warning and a clean start (restart).
  std::optional<Manifest> choose() {
    CheckpointScan scan = scanCheckpoints(opts.dir, *fs);
    for (const auto& w : scan.skipped) DISTILL_LOG(kWarning) << "checkpoint: " << w;
    for (const auto& r : scan.rejected) DISTILL_LOG(kWarning) << "checkpoint: skipping corrupt checkpoint " << r;
    if (scan.chosen || scan.rejected.empty()) return scan.chosen;
    std::string all;
    for (const auto& r : scan.rejected) all += (all.empty() ? "" : "; ") + r;
    const std::string text = "no intact checkpoint in " + opts.dir + ": " + all;
    if (opts.on_corrupt == OnCorrupt::kRestart) {
      DISTILL_LOG(kWarning) << "checkpoint: " << text
                            << "; checkpoint.on_corrupt=restart: training starts from scratch";
      return std::nullopt;
    }
    DISTILL_THROW(CheckpointError, text,
                  "; nothing was loaded or removed (checkpoint.on_corrupt: restart starts from scratch instead)");
  }

  // Rank 0: how the config checkpoint `m` was saved under differs from this
  // run's, in training keys (the only ones its config hash covers).
  std::string configChange(const Manifest& m) {
    const std::string dir = path(stepName(m.step));
    if (!m.find(kConfig)) {
      return "its config hash differs (it records no " + std::string(kConfig) + ": saved by an older distill)";
    }
    try {
      auto changes = configChanges(readVerified(dir, m, kConfig), config);
      if (changes.empty()) {
        return "its config hash differs, but no training key does (hashed by another version of distill?)";
      }
      return join(changes);
    } catch (const Error& e) {
      return "its config hash differs (" + dir + "/" + kConfig + " cannot be compared: " + e.message() + ")";
    }
  }

  // Reads `name` of checkpoint `dir`, checking it against the manifest.
  std::string readVerified(const std::string& dir, const Manifest& m, const std::string& name) {
    const std::string p = dir + "/" + name;
    const ManifestFile* f = m.find(name);
    DISTILL_CHECK_T(CheckpointError, f, "manifest of ", dir, " does not list ", name);
    std::string bytes = fs->readFile(p);
    DISTILL_CHECK_T(CheckpointError,
                    static_cast<int64_t>(bytes.size()) == f->size && crc32c(bytes.data(), bytes.size()) == f->crc32c,
                    "corrupt file ", p, ": size or CRC32C differ from the manifest");
    return bytes;
  }

  LoadedState loadStep(int64_t step, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                       std::mt19937_64* rng) {
    LoadedState out;
    out.step = step;
    out.path = path(stepName(step));
    const std::string& dir = out.path;
    Manifest m = parseManifest(fs->readFile(dir + "/" + kManifest), dir + "/" + kManifest);
    auto dev = deviceOf(model);
    auto open = [&](const std::string& name, InputArchive& a, std::optional<torch::Device> d) {
      std::string bytes = readVerified(dir, m, name);
      a.load_from(bytes.data(), bytes.size(), d);
    };
    InputArchive ma, oa, ta, ra;
    open(kModel, ma, dev);
    open(kOptimizer, oa, dev);
    open(kTrain, ta, torch::Device(torch::kCPU));
    open(rankFile(rank), ra, torch::Device(torch::kCPU));
    DISTILL_CHECK_T(CheckpointError, readInt(ra, "rank") == rank && readInt(ra, "step") == step,
                    dir, "/", rankFile(rank), " is not rank ", rank, "'s file of step ", step);
    model.load(ma);
    optimizer.load(oa);
    out.train.step = readInt(ta, "step");
    out.train.accStep = readInt(ta, "acc_step");
    out.train.tokensSeen = readInt(ta, "tokens_seen");
    out.train.data = {readInt(ta, "data_epoch"), readInt(ta, "data_index")};
    out.train.extra = tensorBytes(readTensor(ta, "extra"));
    out.rank.data = {readInt(ra, "data_epoch"), readInt(ra, "data_index")};
    out.rank.extra = tensorBytes(readTensor(ra, "extra"));
    // RNG last: nothing above may fail after it is restored.
    bool hasMt = readInt(ra, "has_mt19937_64") != 0;
    if (rng && !hasMt) {
      DISTILL_LOG(kWarning) << "checkpoint " << dir << " holds no std::mt19937_64 state for rank " << rank
                            << "; the generator given to loadLatest is left as it is";
    } else if (rng) {
      std::istringstream is(tensorBytes(readTensor(ra, "mt19937_64")));
      std::mt19937_64 restored;
      is >> restored;
      DISTILL_CHECK_T(CheckpointError, !is.fail(), "bad std::mt19937_64 state in ", dir, "/", rankFile(rank));
      *rng = restored;
    }
    int64_t cudaGens = readInt(ra, "rng_cuda_count");
    if (cudaGens > 0 && static_cast<int64_t>(at::getNumGPUs()) == cudaGens) {
      for (int64_t i = 0; i < cudaGens; ++i) {
        auto gen = at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, static_cast<int>(i)));
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(readTensor(ra, "rng_cuda_" + std::to_string(i)));
      }
    } else if (cudaGens > 0) {
      DISTILL_LOG(kWarning) << "checkpoint " << dir << " holds " << cudaGens << " CUDA generator states, "
                            << at::getNumGPUs() << " devices are visible: CUDA RNG not restored";
    }
    auto gen = cpuGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(readTensor(ra, "rng_cpu"));
    return out;
  }
};

}  // namespace

struct CheckpointManager::Impl {
  StudentGroup* group = nullptr;
  std::shared_ptr<CheckpointCore> core;
  int64_t saveSeq = 0;  // async saves so far: the same on every rank (save() is collective)

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
      auto table = torch::zeros({c.world, 4}, torch::kLong);  // failed, size, crc, no space
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
      auto out = torch::zeros({4}, torch::kLong);  // code, publish failed, full, kept
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
      if (c.rank == 0) c.removeTmp(tmpDir);  // every rank is done with it
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
      return failSave(p.step, "the background writer is still writing or publishing " + p.tmpDir + " after " +
                                  std::to_string(writerPatience().count()) +
                                  " ms (3 x run.collective_timeout_s)");
    }
    if (p.result->ok) return true;  // the writer is idle: its result happens-before (mutex)
    return failSave(p.step, p.result->error);
  }
};

CheckpointManager::CheckpointManager(StudentContext& ctx)
    : CheckpointManager(ctx, ctx.config().checkpoint) {}

CheckpointManager::CheckpointManager(StudentContext& ctx, CheckpointOptions opts,
                                     std::string teacherFingerprint, std::shared_ptr<FileSystem> fs)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.core = std::make_shared<CheckpointCore>();
  CheckpointCore& c = *s.core;
  s.group = &ctx.group();
  c.opts = std::move(opts);
  while (c.opts.dir.size() > 1 && c.opts.dir.back() == '/') c.opts.dir.pop_back();
  c.fingerprint = std::move(teacherFingerprint);
  c.fs = fs ? std::move(fs) : posixFileSystem();
  c.cfgHash = configHash(ctx.config());
  c.config = ctx.config();
  c.configYaml = dumpConfig(c.config);
  c.rank = ctx.rank();
  c.world = ctx.worldSize();
  c.timeout = s.group->timeout();
  DISTILL_CHECK_T(ConfigError, c.opts.on_error == OnSaveError::kStop || c.opts.on_error == OnSaveError::kContinue,
                  "checkpoint.on_error must be stop or continue, got value ", static_cast<int>(c.opts.on_error));
  DISTILL_CHECK_T(ConfigError, c.opts.keep_last >= 1, "checkpoint.keep_last must be >= 1, got ",
                  c.opts.keep_last);
  DISTILL_CHECK_T(ConfigError, c.opts.on_corrupt == OnCorrupt::kError || c.opts.on_corrupt == OnCorrupt::kRestart,
                  "checkpoint.on_corrupt must be error or restart, got value ", static_cast<int>(c.opts.on_corrupt));
  if (c.opts.dir.empty()) return;  // disabled, on every rank alike (same config)

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
    s.writerThread.detach();  // it owns what it uses (shared state, its task)
  }
}

bool CheckpointManager::enabled() const { return !impl_->core->opts.dir.empty(); }
const CheckpointOptions& CheckpointManager::options() const { return impl_->core->opts; }
bool CheckpointManager::due(int64_t step) const {
  return enabled() && impl_->core->opts.every_steps > 0 && step % impl_->core->opts.every_steps == 0;
}

bool CheckpointManager::wait() {
  return enabled() ? impl_->finishPending() : true;
}

bool CheckpointManager::save(int64_t step, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                             const TrainState& train, const RankState& rank, std::mt19937_64* rng) {
  auto& s = *impl_;
  CheckpointCore& c = *s.core;
  if (!enabled()) return false;
  DISTILL_CHECK_T(CheckpointError, step >= 0, "checkpoint step must be >= 0, got ", step);
  trace::Scope recorded(checkpointEvent("save", step));  // the hang table shows a stuck save
  bool previousOk = s.finishPending();
  const std::string tmpDir = c.path(stepName(step) + ".tmp");
  auto start = Clock::now();
  std::vector<OutFile> files;
  std::string snapError;
  try {
    files = c.snapshot(step, model, optimizer, train, rank, rng);
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

std::optional<LoadedState> CheckpointManager::loadLatest(torch::nn::Module& model,
                                                         torch::optim::Optimizer& optimizer,
                                                         std::mt19937_64* rng) {
  auto& s = *impl_;
  CheckpointCore& c = *s.core;
  if (!enabled()) return std::nullopt;
  trace::Scope recorded(checkpointEvent("load", -1));
  s.finishPending();
  // Rank 0 chooses; [status (0 none, 1 found, 2 error), step, saved world size].
  auto choice = torch::zeros({3}, torch::kLong);
  std::string err;
  std::optional<Manifest> chosen;
  if (c.rank == 0) {
    try {
      chosen = c.choose();
      if (chosen) choice = torch::tensor({int64_t{1}, chosen->step, int64_t{chosen->studentWorldSize}});
    } catch (const std::exception& e) {
      err = messageOf(e);
      choice[0] = 2;
    }
  }
  s.group->broadcast(choice, 0, "checkpoint load: choice");
  const int64_t status = choice[0].item<int64_t>(), step = choice[1].item<int64_t>();
  const int64_t savedWorld = choice[2].item<int64_t>();
  if (status == 2) {  // every rank throws rank 0's reason
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
                  "ranks; resume with ", savedWorld, " students or start from a fresh checkpoint.dir");
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
    out = c.loadStep(step, model, optimizer, rng);
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
                  err.empty() ? "student rank(s) " + join(bad) + " could not load it (their logs say why)"
                              : err);
  DISTILL_LOG(kInfo) << "checkpoint: resumed from " << dir << " (train step " << out->train.step << ")";
  return out;
}

}  // namespace distill
