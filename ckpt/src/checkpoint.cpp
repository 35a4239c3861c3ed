#include "distill/ckpt/checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/context.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/student_group.h"
#include "distill/core/trace.h"
#include "layout.h"

namespace distill {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;
using namespace ckpt_layout;

constexpr int64_t kRankFormat = 1;

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

// One file of a checkpoint: bytes ready, or an archive the writer serializes.
struct OutFile {
  std::string name;
  std::string bytes;
  std::shared_ptr<OutputArchive> archive;
};

// What a background (or inline) write produced on this rank.
struct WriteResult {
  std::string error;                // "" when every file is written and fsynced
  std::vector<ManifestFile> files;  // name, size, CRC32C of each
};

// Creates `dir` and writes `files` into it (each fsynced). Throws CheckpointError.
WriteResult writeFiles(FileSystem& fs, const std::string& dir, std::vector<OutFile>& files) {
  WriteResult r;
  fs.createDirs(dir);
  for (auto& f : files) {
    if (f.archive) {
      f.bytes = toBytes(*f.archive);
      f.archive.reset();
    }
    fs.writeFile(dir + "/" + f.name, f.bytes);
    r.files.push_back({f.name, static_cast<int64_t>(f.bytes.size()), crc32c(f.bytes.data(), f.bytes.size())});
    std::string().swap(f.bytes);
  }
  return r;
}

// The single background writer of an async manager. Its state is shared with
// the thread, so that a thread stuck in I/O past every deadline can be detached.
// It runs file I/O only, never a collective.
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

}  // namespace

struct CheckpointManager::Impl {
  StudentGroup* group = nullptr;
  CheckpointOptions opts;
  std::string fingerprint;
  std::shared_ptr<FileSystem> fs;
  uint64_t cfgHash = 0;
  int rank = 0;
  int world = 1;
  Millis timeout{0};

  // Async only.
  std::shared_ptr<Writer> writer;
  std::thread writerThread;
  struct Pending {
    int64_t step;
    std::string tmpDir;
    std::shared_ptr<WriteResult> result;  // filled by the writer before it goes idle
  };
  std::optional<Pending> pending;

  std::string path(const std::string& name) const { return opts.dir + "/" + name; }

  // on_error policy for a failed save; every rank calls it with the same outcome.
  bool failSave(int64_t step, const std::string& msg) {
    std::string text = "checkpoint step " + std::to_string(step) + " not saved: " + msg +
                       "; the previous checkpoint is intact";
    if (opts.on_error == "continue") {
      DISTILL_LOG(kError) << text << " (checkpoint.on_error=continue: training goes on)";
      return false;
    }
    DISTILL_THROW(CheckpointError, ErrorWhere{step, std::nullopt, ""}, text);
  }

  static std::string rankList(const std::vector<int>& ranks) {
    std::string s;
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
    return s;
  }

  // Collective, caller's thread. Every rank reports whether its files of `step`
  // are durable (with its rank file's size and CRC); if all are, rank 0 writes
  // the manifest and publishes, and tells the others. The second collective is
  // the barrier after which the checkpoint is durable everywhere.
  bool agreeAndPublish(int64_t step, const std::string& tmpDir, const WriteResult& mine) {
    const std::string stepTag = "checkpoint step " + std::to_string(step);
    auto table = torch::zeros({world, 3}, torch::kLong);
    auto acc = table.accessor<int64_t, 2>();
    const ManifestFile* own = nullptr;
    for (const auto& f : mine.files) {
      if (f.name == rankFile(rank)) own = &f;
    }
    if (!mine.error.empty() || !own) {
      acc[rank][0] = 1;
    } else {
      acc[rank][1] = own->size;
      acc[rank][2] = own->crc32c;
    }
    group->allReduce(table, ReduceOp::kSum, stepTag + ": rank files written");
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (acc[r][0] != 0) failed.push_back(r);
    }
    std::string err;
    if (failed.empty()) {
      int64_t pubFailed = 0;
      if (rank == 0) {
        try {
          publish(step, tmpDir, mine, acc);
        } catch (const std::exception& e) {
          err = messageOf(e);
          pubFailed = 1;
        }
      }
      auto flag = torch::full({1}, pubFailed, torch::kLong);
      group->broadcast(flag, 0, stepTag + ": published");
      if (flag.item<int64_t>() == 0) return true;
      if (rank != 0) err = "student rank 0 could not publish it (its log says why)";
    } else if (!mine.error.empty()) {
      err = mine.error;
      if (failed.size() > 1) err += " (student rank(s) " + rankList(failed) + " failed)";
    } else {
      err = "student rank(s) " + rankList(failed) + " could not write their state (their logs say why)";
    }
    if (rank == 0) {
      try {  // best effort: every rank is done with tmpDir here
        fs->removeAll(tmpDir);
      } catch (const std::exception& e) {
        DISTILL_LOG(kWarning) << "checkpoint: could not remove " << tmpDir << ": " << messageOf(e);
      }
    }
    return failSave(step, err);
  }

  static std::string messageOf(const std::exception& e) {
    if (auto de = dynamic_cast<const Error*>(&e)) return de->message();
    return e.what();
  }

  // Rank 0, caller's thread, after every rank's files of `step` are durable.
  void publish(int64_t step, const std::string& tmpDir, const WriteResult& mine,
               const at::TensorAccessor<int64_t, 2>& table) {
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
    for (int r = 0; r < world; ++r) {
      m.files.push_back({rankFile(r), table[r][1], static_cast<uint32_t>(table[r][2])});
    }
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

  // Collective when something is pending: the async save in flight is waited
  // for (bounded), agreed on and published, in this (the caller's) thread.
  bool finishPending() {
    if (!pending) return true;
    Pending p = std::move(*pending);
    pending.reset();
    WriteResult mine;
    if (!writer->waitIdle(Deadline::after(timeout))) {
      mine.error = "the background writer is still writing " + p.tmpDir + " after " +
                   std::to_string(timeout.count()) + " ms (run.collective_timeout_s)";
    } else {
      mine = *p.result;  // the writer is idle: its writes happen-before (mutex)
    }
    return agreeAndPublish(p.step, p.tmpDir, mine);
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
    if (opts.on_corrupt == "restart") {
      DISTILL_LOG(kWarning) << "checkpoint: " << text
                            << "; checkpoint.on_corrupt=restart: training starts from scratch";
      return std::nullopt;
    }
    DISTILL_THROW(CheckpointError, text,
                  "; nothing was loaded or removed (checkpoint.on_corrupt: restart starts from scratch instead)");
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

CheckpointManager::CheckpointManager(StudentContext& ctx)
    : CheckpointManager(ctx, ctx.config().checkpoint) {}

CheckpointManager::CheckpointManager(StudentContext& ctx, CheckpointOptions opts,
                                     std::string teacherFingerprint, std::shared_ptr<FileSystem> fs)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.group = &ctx.group();
  s.opts = std::move(opts);
  while (s.opts.dir.size() > 1 && s.opts.dir.back() == '/') s.opts.dir.pop_back();
  s.fingerprint = std::move(teacherFingerprint);
  s.fs = fs ? std::move(fs) : posixFileSystem();
  s.cfgHash = configHash(ctx.config());
  s.rank = ctx.rank();
  s.world = ctx.worldSize();
  s.timeout = s.group->timeout();
  DISTILL_CHECK_T(ConfigError, s.opts.on_error == "stop" || s.opts.on_error == "continue",
                  "checkpoint.on_error must be stop or continue, got ", s.opts.on_error);
  DISTILL_CHECK_T(ConfigError, s.opts.keep_last >= 1, "checkpoint.keep_last must be >= 1, got ",
                  s.opts.keep_last);
  DISTILL_CHECK_T(ConfigError, s.opts.on_corrupt == "error" || s.opts.on_corrupt == "restart",
                  "checkpoint.on_corrupt must be error or restart, got ", s.opts.on_corrupt);
  if (s.opts.dir.empty()) return;  // disabled, on every rank alike (same config)

  // Rank 0 makes the directory; the broadcast is the student-group barrier
  // (postmortems/000: the teacher is not in this group) and carries the outcome.
  std::string err;
  if (s.rank == 0) {
    try {
      s.fs->createDirs(s.opts.dir);
      s.fs->syncDir(s.opts.dir);
      auto slash = s.opts.dir.rfind('/');
      s.fs->syncDir(slash == std::string::npos ? "." : slash == 0 ? "/" : s.opts.dir.substr(0, slash));
    } catch (const std::exception& e) {
      err = Impl::messageOf(e);
    }
  }
  auto flag = torch::full({1}, static_cast<int64_t>(!err.empty()), torch::kLong);
  s.group->broadcast(flag, 0, "checkpoint directory " + s.opts.dir);
  DISTILL_CHECK_T(CheckpointError, flag.item<int64_t>() == 0, "checkpoint directory: ",
                  err.empty() ? "student rank 0 could not create " + s.opts.dir + " (its log says why)" : err);
  if (s.opts.async) {
    s.writer = std::make_shared<Writer>();
    s.writerThread = std::thread(Writer::loop, s.writer);
  }
}

CheckpointManager::~CheckpointManager() {
  auto& s = *impl_;
  if (!s.writer) return;
  bool idle = s.writer->waitIdle(Deadline::after(s.timeout));
  if (s.pending) {
    if (!idle) {
      DISTILL_LOG(kError) << "checkpoint: the background writer is still writing " << s.pending->tmpDir
                          << " after " << s.timeout.count() << " ms; abandoning it";
    } else if (!s.pending->result->error.empty()) {
      DISTILL_LOG(kError) << "checkpoint step " << s.pending->step
                          << " failed (unreported): " << s.pending->result->error;
    } else {
      DISTILL_LOG(kWarning) << "checkpoint step " << s.pending->step << " was written to " << s.pending->tmpDir
                            << " but never published: call wait() on every rank before destroying "
                               "the CheckpointManager";
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

bool CheckpointManager::enabled() const { return !impl_->opts.dir.empty(); }
const CheckpointOptions& CheckpointManager::options() const { return impl_->opts; }
bool CheckpointManager::due(int64_t step) const {
  return enabled() && impl_->opts.every_steps > 0 && step % impl_->opts.every_steps == 0;
}

bool CheckpointManager::wait() {
  return enabled() ? impl_->finishPending() : true;
}

bool CheckpointManager::save(int64_t step, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                             const TrainState& train, const RankState& rank, std::mt19937_64* rng) {
  auto& s = *impl_;
  if (!enabled()) return false;
  DISTILL_CHECK_T(CheckpointError, step >= 0, "checkpoint step must be >= 0, got ", step);
  trace::Scope recorded(checkpointEvent("save", step));  // the hang table shows a stuck save
  bool previousOk = s.finishPending();
  const std::string tmpDir = s.path(stepName(step) + ".tmp");
  auto start = Clock::now();
  std::vector<OutFile> files;
  std::string snapError;
  try {
    files = s.snapshot(step, model, optimizer, train, rank, rng);
  } catch (const std::exception& e) {
    snapError = "cannot serialize the state: " + Impl::messageOf(e);
  }
  if (!s.opts.async) {
    WriteResult mine;
    mine.error = snapError;
    if (snapError.empty()) {
      try {
        mine = writeFiles(*s.fs, tmpDir, files);
      } catch (const std::exception& e) {
        mine.error = Impl::messageOf(e);
      }
    }
    bool ok = s.agreeAndPublish(step, tmpDir, mine);
    DISTILL_LOG(kDebug) << "checkpoint step " << step << ": save took " << toMs(Clock::now() - start) << " ms";
    return ok && previousOk;
  }
  // Async: the writer does file I/O only; agreement and publication come at the
  // next agreement point on every rank alike, also when the snapshot failed here.
  auto result = std::make_shared<WriteResult>();
  s.pending = Impl::Pending{step, tmpDir, result};
  if (snapError.empty() && !s.writer->waitIdle(Deadline::after(s.timeout))) {
    snapError = "the background writer is still busy with an abandoned checkpoint after " +
                std::to_string(s.timeout.count()) + " ms";
  }
  if (!snapError.empty()) {
    result->error = snapError;
    return previousOk;
  }
  auto fs = s.fs;
  auto task = [fs, tmpDir, result, files = std::move(files)]() mutable {
    try {
      *result = writeFiles(*fs, tmpDir, files);
    } catch (const std::exception& e) {
      result->error = Impl::messageOf(e);
    } catch (...) {
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
  if (!enabled()) return std::nullopt;
  trace::Scope recorded(checkpointEvent("load", -1));
  s.finishPending();
  // Rank 0 chooses; [status (0 none, 1 found, 2 error), step, saved world size].
  auto choice = torch::zeros({3}, torch::kLong);
  std::string err;
  std::optional<Manifest> chosen;
  if (s.rank == 0) {
    try {
      chosen = s.choose();
      if (chosen) choice = torch::tensor({int64_t{1}, chosen->step, int64_t{chosen->studentWorldSize}});
    } catch (const std::exception& e) {
      err = Impl::messageOf(e);
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
    DISTILL_LOG(kInfo) << "checkpoint: no checkpoint to load in " << s.opts.dir << ": clean start";
    return std::nullopt;
  }
  const std::string dir = s.path(stepName(step));
  DISTILL_CHECK_T(CheckpointError, savedWorld == s.world, "checkpoint ", dir, " was saved by ", savedWorld,
                  " student ranks, this run has ", s.world,
                  ": per-rank state (RNG, data position) cannot be re-split over a different number of "
                  "ranks; resume with ", savedWorld, " students or start from a fresh checkpoint.dir");
  if (chosen) {
    if (chosen->configHash != s.cfgHash) {
      DISTILL_LOG(kWarning) << "checkpoint " << dir << " was saved under another config (hash differs)";
    }
    if (chosen->teacherFingerprint != s.fingerprint) {
      DISTILL_LOG(kWarning) << "checkpoint " << dir << " was saved with teacher \"" << chosen->teacherFingerprint
                            << "\", this run has \"" << s.fingerprint << "\"";
    }
  }
  std::optional<LoadedState> out;
  try {
    out = s.loadStep(step, model, optimizer, rng);
  } catch (const std::exception& e) {
    err = Impl::messageOf(e);
  }
  auto failed = torch::zeros({s.world}, torch::kLong);
  failed[s.rank] = err.empty() ? 0 : 1;
  s.group->allReduce(failed, ReduceOp::kSum, "checkpoint load: step " + std::to_string(step));
  std::vector<int> bad;
  for (int r = 0; r < s.world; ++r) {
    if (failed[r].item<int64_t>() != 0) bad.push_back(r);
  }
  DISTILL_CHECK_T(CheckpointError, bad.empty(), "checkpoint load of ", dir, " failed: ",
                  err.empty() ? "student rank(s) " + Impl::rankList(bad) + " could not load it (their logs say why)"
                              : err);
  DISTILL_LOG(kInfo) << "checkpoint: resumed from " << dir << " (train step " << out->train.step << ")";
  return out;
}

}  // namespace distill
