#pragma once

// What every ckpt test file shares: the child side (a student process under a
// real gloo group, a tiny trainer, file systems with faults) and the test side
// (CkptTest: the job of real processes, their logs).

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <sys/stat.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <numeric>
#include <random>
#include <regex>

#include "distill/ckpt/checkpoint.h"
#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/context.h"
#include "distill/group/student_context.h"
#include "distill/core/errors.h"
#include "distill/group/student_group.h"
#include "support/process.h"
#include "support/roles.h"

using namespace std::chrono;
namespace dt = distill::testing;
using Args = std::map<std::string, std::string>;

namespace ckpt_test {

// ---- child side -----------------------------------------------------------

inline Args parseArgs(const std::vector<std::string>& args) {
  Args m;
  for (const auto& a : args) {
    auto eq = a.find('=');
    m[a.substr(0, eq)] = eq == std::string::npos ? "" : a.substr(eq + 1);
  }
  return m;
}

inline std::string get(const Args& a, const std::string& k, const std::string& def = "") {
  auto it = a.find(k);
  return it == a.end() ? def : it->second;
}

inline distill::Config childConfig(const Args& a) {
  distill::Config c;
  c.run.startup_timeout_s = 30;
  c.run.collective_timeout_s = std::stod(get(a, "timeout", "20"));
  c.checkpoint.dir = get(a, "dir");
  c.checkpoint.async = get(a, "async", "0") == "1";
  c.checkpoint.on_error = distill::parseEnum<distill::OnSaveError>(get(a, "on_error", "stop")).value();
  c.checkpoint.keep_last = std::stoi(get(a, "keep", "3"));
  c.checkpoint.on_corrupt = distill::parseEnum<distill::OnCorrupt>(get(a, "on_corrupt", "error")).value();
  if (a.count("alpha")) c.loss.alpha = std::stod(get(a, "alpha"));
  if (a.count("seed")) c.run.seed = std::stoll(get(a, "seed"));
  if (a.count("log_dir")) c.run.log_dir = get(a, "log_dir");
  if (a.count("file_mode")) c.run.file_mode = distill::parseEnum<distill::FileMode>(get(a, "file_mode")).value();
  return c;
}

inline void report(const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); }

// Runs a student body; maps errors to exit codes (2 checkpoint, 3 timeout, 4 peer lost, 5 other).
inline int studentMain(const Args& a, const std::function<int(distill::StudentContext&)>& body) {
  torch::set_num_threads(1);
  auto start = steady_clock::now();
  try {
    distill::StudentContext ctx(distill::Topology::fromEnvironment(), childConfig(a));
    start = steady_clock::now();
    return body(ctx);
  } catch (const std::exception& e) {
    report("ERROR after " + std::to_string(distill::msSince(start)) + " ms: " + e.what());
    if (dynamic_cast<const distill::CheckpointError*>(&e)) return 2;
    if (dynamic_cast<const distill::TimeoutError*>(&e)) return 3;
    if (dynamic_cast<const distill::PeerLostError*>(&e)) return 4;
    return 5;
  }
}

// A 2-layer MLP with dropout (so the CPU RNG matters), identical on every rank.
inline torch::nn::Sequential makeNet() {
  torch::manual_seed(42);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                               torch::nn::Linear(16, 1));
}

struct Trainer {
  distill::StudentContext& ctx;
  torch::nn::Sequential net = makeNet();
  torch::optim::Adam opt{net->parameters(), torch::optim::AdamOptions(1e-2)};
  std::mt19937_64 mt;
  distill::TrainState train;
  distill::RankState rs;

  explicit Trainer(distill::StudentContext& c) : ctx(c), mt(99 + c.rank()) {
    torch::manual_seed(1000 + c.rank()); // dropout stream, per rank
  }

  // One data-parallel step on a synthetic stream driven by the data position
  // (plus noise from `mt`); returns this rank's loss.
  float step() {
    const int rank = ctx.rank();
    auto base = torch::arange(16 * 8, torch::kFloat).view({16, 8});
    double phase = 0.1 * static_cast<double>(rs.data.index + 1) + 1.3 * static_cast<double>(rs.data.epoch) + 0.7 * rank;
    double noise = std::uniform_real_distribution<double>(-0.5, 0.5)(mt);
    auto x = torch::sin(base * 0.05 + phase) + noise;
    auto y = x.sum(1, true).cos();
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(x), y);
    loss.backward();
    for (auto& p : net->parameters()) {
      auto g = p.grad();
      ctx.group().allReduce(g, distill::ReduceOp::kSum, "grads");
      g.div_(ctx.worldSize());
    }
    opt.step();
    if (++rs.data.index == 7) rs.data = {rs.data.epoch + 1, 0};
    train.step += 1;
    train.tokensSeen += 16 * ctx.worldSize();
    train.data = rs.data;
    return loss.item<float>();
  }

  bool save(distill::CheckpointManager& m) { return m.save(train.step, *net, opt, train, rs, &mt); }
  std::optional<distill::LoadedState> load(distill::CheckpointManager& m) {
    auto l = m.loadLatest(*net, opt, &mt);
    if (l) {
      train = l->train;
      rs = l->rank;
    }
    return l;
  }
};

inline std::string hexBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", u);
  return buf;
}

// Raises SIGKILL on itself right after writing `killAfter` (rank 1 in mid-save).
class KillingFileSystem : public distill::PosixFileSystem {
 public:
  explicit KillingFileSystem(std::string killAfter) : killAfter_(std::move(killAfter)) {}
  void writeFile(const std::string& path, const std::string& bytes) override {
    PosixFileSystem::writeFile(path, bytes);
    if (!killAfter_.empty() && path.find(killAfter_) != std::string::npos) raise(SIGKILL);
  }

 private:
  std::string killAfter_;
};

// Holds writes of paths containing `gated` until open() (bounded); fails every
// write of paths containing `failing` with ENOSPC (a device that stays full:
// the save's one retry after making room fails too).
class GatedFileSystem : public distill::PosixFileSystem {
 public:
  GatedFileSystem(std::string gated, std::string failing)
      : gated_(std::move(gated)), failing_(std::move(failing)), gate_(opened_.get_future().share()) {}
  void open() { opened_.set_value(); }
  bool passed() const { return passed_.load(); }

 protected:
  int fault(distill::FsOp op, const std::string& path) override {
    if (op != distill::FsOp::kWrite) return 0;
    if (path.find(gated_) != std::string::npos) {
      if (gate_.wait_for(seconds(30)) != std::future_status::ready) return EIO;
      passed_ = true;
    }
    if (!failing_.empty() && path.find(failing_) != std::string::npos) return ENOSPC;
    return 0;
  }

 private:
  std::string gated_, failing_;
  std::promise<void> opened_;
  std::shared_future<void> gate_;
  std::atomic<bool> passed_{false};
};

inline distill::FsOp opNamed(const std::string& s) {
  for (auto op : {distill::FsOp::kMkdir, distill::FsOp::kOpen, distill::FsOp::kWrite, distill::FsOp::kFsync,
                  distill::FsOp::kRename, distill::FsOp::kRemove, distill::FsOp::kList}) {
    if (s == distill::fsOpName(op)) return op;
  }
  throw std::runtime_error("unknown op " + s);
}

// ---- test side --------------------------------------------------------------

inline std::map<std::string, std::string> envFor(int local, int perNode, int port) {
  distill::Topology t = distill::Topology::forLocalRank(0, 1, local, perNode);
  t.masterPort = port;
  return distill::topologyEnv(t);
}

// Lines "KEY rest" of a log, by key.
inline std::vector<std::string> linesOf(const std::string& log, const std::string& key) {
  std::vector<std::string> out;
  std::istringstream is(log);
  for (std::string l; std::getline(is, l);) {
    if (l.rfind(key + " ", 0) == 0) out.push_back(l.substr(key.size() + 1));
  }
  return out;
}

// (No std::filesystem: libtorch.so exports a clashing copy of it.)
inline bool fileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

inline bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

class CkptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + dt::uniqueName("distill-ck");
    distill::PosixFileSystem().createDirs(dir_);
  }
  void TearDown() override {
    // Kept for a look when a test failed or DISTILL_TEST_KEEP is set.
    if (!HasFailure() && !std::getenv("DISTILL_TEST_KEEP")) distill::PosixFileSystem().removeAll(dir_);
  }

  struct Result {
    std::vector<dt::ExitStatus> status;
    std::vector<std::string> logs;
    int64_t ms = 0;
  };

  // Runs `students` ranks of `role` (and a live teacher when asked) to the end.
  Result run(const std::string& role, int students, std::vector<std::string> args, bool teacher = false,
             seconds limit = seconds(120)) {
    const int port = dt::freePort();
    const int perNode = students + 1;
    args.push_back("dir=" + dir_ + "/ckpt");
    std::vector<std::string> logs;
    for (int r = 0; r < perNode; ++r) {
      logs.push_back(dir_ + "/" + role + "-" + std::to_string(runs_) + "-r" + std::to_string(r) + ".log");
    }
    ++runs_;
    dt::Child t;
    if (teacher) t = dt::spawnRole("teacher", {}, envFor(students, perNode, port), logs[students]);
    auto start = steady_clock::now();
    std::vector<dt::Child> kids;
    for (int r = 0; r < students; ++r) kids.push_back(dt::spawnRole(role, args, envFor(r, perNode, port), logs[r]));
    Result res;
    for (int r = 0; r < students; ++r) {
      res.status.push_back(kids[r].join(limit));
      res.logs.push_back(dt::readFile(logs[r]));
    }
    res.ms = duration_cast<milliseconds>(steady_clock::now() - start).count();
    if (teacher) {
      // Alive throughout: it never joined anything, so nothing waited on it.
      EXPECT_FALSE(t.waitFor(milliseconds(0))) << dt::readFile(logs[students]);
      t.kill(SIGTERM);
      auto ts = t.join(seconds(10));
      EXPECT_TRUE(ts.exited && ts.code == 0) << ts.describe() << dt::readFile(logs[students]);
    }
    return res;
  }

  static void expectExit(const Result& r, int rank, int code) {
    EXPECT_TRUE(r.status[rank].exited && r.status[rank].code == code)
        << "rank " << rank << ": " << r.status[rank].describe() << "\n"
        << r.logs[rank];
  }
  static void expectAllOk(const Result& r) {
    for (size_t i = 0; i < r.status.size(); ++i) expectExit(r, static_cast<int>(i), 0);
  }
  std::string ckpt(const std::string& rel = "") const { return dir_ + "/ckpt" + (rel.empty() ? "" : "/" + rel); }

  std::string dir_;
  int runs_ = 0;
};

} // namespace ckpt_test

using namespace ckpt_test;
