// bench_grad_sync: a data-parallel step of 2 students (real processes under
// distill-run, gloo on the student group) in three modes, interleaved in rounds
// in one run:
//
//   no_sync         forward + backward + optimizer step, no all-reduce: the
//                   student-only step, the baseline
//   after_backward  the same, then allReduceGradients (buckets one after the
//                   other, after backward)
//   overlapped      GradientSync: buckets all-reduced from post-accumulate-grad
//                   hooks while backward still runs (what distill::Steps does)
//
// The model is an MLP of --layers Linear(--width, --width) (+ ReLU), big
// enough for its gradients to take time on the wire; --bucket-mb sets the
// buckets. Prints JSON lines, per mode and a summary:
//   {"bench":"grad_sync","mode":"overlapped","step_ms_p50":…,"ratio_to_no_sync":…,…}
//   {"bench":"grad_sync","summary":…,"overlapped_vs_after_backward":…,…}
//
//   build/bin/bench_grad_sync [--layers 6] [--width 1024] [--batch 64] [--bucket-mb 4]
//                             [--steps 20] [--warmup 3] [--rounds 3] [--threads 1]
#include <limits.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <distill/distill.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using SteadyClock = std::chrono::steady_clock;

struct Args {
  int layers = 6, width = 1024, batch = 64, steps = 20, warmup = 3, rounds = 3, threads = 1;
  double bucketMb = 4;
  std::string inner; // set under distill-run: where student rank 0 writes its JSON
};

Args parseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--layers")
      a.layers = std::stoi(value());
    else if (f == "--width")
      a.width = std::stoi(value());
    else if (f == "--batch")
      a.batch = std::stoi(value());
    else if (f == "--bucket-mb")
      a.bucketMb = std::stod(value());
    else if (f == "--steps")
      a.steps = std::stoi(value());
    else if (f == "--warmup")
      a.warmup = std::stoi(value());
    else if (f == "--rounds")
      a.rounds = std::stoi(value());
    else if (f == "--threads")
      a.threads = std::stoi(value());
    else if (f == "--inner")
      a.inner = value();
    else
      throw std::runtime_error("unknown option " + f +
                               "; usage: bench_grad_sync [--layers N] [--width N] [--batch N] [--bucket-mb M] "
                               "[--steps N] [--warmup N] [--rounds N] [--threads N]");
  }
  if (a.layers < 1 || a.width < 1 || a.batch < 1 || a.steps < 1 || a.rounds < 1 || a.warmup < 0 || a.bucketMb <= 0)
    throw std::runtime_error("--layers, --width, --batch, --steps, --rounds >= 1, --warmup >= 0, --bucket-mb > 0");
  return a;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

std::string exePath() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  buf[n] = '\0';
  return buf;
}

// ---- under distill-run ----

int student(const Args& a, distill::Session& s) {
  torch::set_num_threads(a.threads);
  auto& group = s.student->group();
  torch::manual_seed(1);
  torch::nn::Sequential model;
  for (int l = 0; l < a.layers; ++l) {
    model->push_back(torch::nn::Linear(a.width, a.width));
    model->push_back(torch::nn::ReLU());
  }
  std::vector<at::Tensor> params = model->parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(1e-4));
  distill::GradientSync sync(group, params, a.bucketMb);
  sync.setSyncing(false);
  enum Mode { kNoSync, kAfterBackward, kOverlapped };
  const char* names[] = {"no_sync", "after_backward", "overlapped"};
  std::vector<double> times[3];
  int startedDuringBackward = 0;
  torch::manual_seed(100 + group.rank());
  const at::Tensor x = torch::randn({a.batch, a.width}), target = torch::randn({a.batch, a.width});
  for (int round = 0; round < a.rounds; ++round) {
    for (Mode m : {kNoSync, kAfterBackward, kOverlapped}) {
      group.barrier("bench: mode starts"); // the students time the same mode together
      for (int i = 0; i < a.warmup + a.steps; ++i) {
        const auto t0 = SteadyClock::now();
        sync.setSyncing(m == kOverlapped);
        (model->forward(x) - target).pow(2).mean().backward();
        if (m == kOverlapped) sync.wait(), sync.setSyncing(false);
        if (m == kAfterBackward) distill::allReduceGradients(group, params, a.bucketMb);
        opt.step();
        opt.zero_grad();
        if (i >= a.warmup)
          times[m].push_back(std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count());
      }
      if (m == kOverlapped) startedDuringBackward = sync.startedDuringBackward();
    }
  }
  s.client->finish();
  if (group.rank() != 0) return 0;
  std::ofstream out(a.inner);
  int64_t numel = 0;
  for (auto& p : params) numel += p.numel();
  const double base = percentile(times[kNoSync], 0.5);
  for (Mode m : {kNoSync, kAfterBackward, kOverlapped}) {
    const double p50 = percentile(times[m], 0.5);
    std::ostringstream l;
    l << "{\"bench\":\"grad_sync\",\"mode\":\"" << names[m] << "\",\"step_ms_p50\":" << p50
      << ",\"step_ms_p10\":" << percentile(times[m], 0.1) << ",\"step_ms_p90\":" << percentile(times[m], 0.9)
      << ",\"steps\":" << times[m].size() << ",\"ratio_to_no_sync\":" << p50 / base << "}\n";
    out << l.str();
  }
  const double after = percentile(times[kAfterBackward], 0.5), over = percentile(times[kOverlapped], 0.5);
  out << "{\"bench\":\"grad_sync\",\"summary\":\"ratios of step_ms_p50\",\"overlapped_vs_after_backward\":"
      << over / after << ",\"sync_ms_after_backward\":" << after - base << ",\"sync_ms_overlapped\":" << over - base
      << ",\"hidden_share\":" << (after > base ? (after - over) / (after - base) : 0)
      << ",\"students\":" << group.size() << ",\"parameters\":" << numel
      << ",\"gradient_mib\":" << double(numel) * 4 / (1 << 20) << ",\"buckets\":" << sync.buckets()
      << ",\"buckets_started_during_backward\":" << startedDuringBackward << ",\"bucket_mb\":" << a.bucketMb
      << ",\"threads_per_student\":" << a.threads << ",\"rounds\":" << a.rounds << "}\n";
  return out.good() ? 0 : 1;
}

int inner(const Args& a) {
  int argc = 1;
  char arg0[] = "bench_grad_sync";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  if (s.isTeacher()) { // teacher.kind self: asked nothing, serves until the students finish
    distill::serve(*s.teacher,
                   distill::teacherFromFunction([](const std::vector<at::Tensor>& in) { return in.at(0); }));
    return 0;
  }
  return student(a, s);
}

// ---- the outer process: the job, then its JSON on stdout ----

int outer(const Args& a, int argc, char** argv) {
  char tmpl[] = "/tmp/distill-bench-grad-XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  const std::string dir = tmpl, results = dir + "/results.jsonl", config = dir + "/job.yaml";
  std::ofstream(config) << "run:\n  name: bench-grad-sync\n  nproc_per_node: 3\n  log_dir: " << dir
                        << "/logs\n  master_port: 0\n  collective_timeout_s: 300\n  hang_timeout_s: 300\n"
                        << "teacher:\n  kind: self\n";
  const std::string self = exePath(), run = self.substr(0, self.rfind('/')) + "/distill-run";
  std::vector<std::string> cmd = {run, "--config", config, "--", self, "--inner", results};
  for (int i = 1; i < argc; ++i) cmd.push_back(argv[i]);
  std::vector<char*> cargv;
  for (auto& c : cmd) cargv.push_back(const_cast<char*>(c.c_str()));
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("OMP_NUM_THREADS", std::to_string(a.threads).c_str(), 1);
    ::dup2(STDERR_FILENO, STDOUT_FILENO); // the job's console on stderr; stdout is for the JSON
    ::execv(cargv[0], cargv.data());
    std::fprintf(stderr, "bench_grad_sync: cannot exec %s\n", cargv[0]);
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0); // distill-run bounds the job (collective_timeout_s, hang_timeout_s)
  std::ifstream in(results);
  std::stringstream text;
  text << in.rdbuf();
  std::fputs(text.str().c_str(), stdout);
  std::system(("rm -rf " + dir).c_str());
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && !text.str().empty();
  if (!ok) std::fprintf(stderr, "bench_grad_sync: the job failed (distill-run status %d)\n", status);
  return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parseArgs(argc, argv);
    return a.inner.empty() ? outer(a, argc, argv) : inner(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_grad_sync: %s\n", e.what());
    return 1;
  }
}
