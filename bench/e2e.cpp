// bench_e2e: the step time of the demo's student in four modes, in one run
// (the same process, model and data; modes interleaved in rounds):
//
//   student_only     trained on labels alone: the trainer without distill
//   teacher_process  distilled through distill's teacher process (a registered
//                    C++ teacher under distill-teacher, micro-batch k+1 in flight
//                    while the student computes k)
//   in_process       distilled from the same teacher run inside the student
//                    process (forward, then the student's step): what a
//                    trainer does without distill
//   teacher_cache    distilled through the teacher process with its output
//                    cache (teacher.cache, readwrite): a pass over the round's
//                    micro-batches fills it, the measured pass over the same
//                    micro-batches is answered from it (every row a hit)
//   teacher_pool     S students (--pool-students, 2) distilled through K teacher
//                    processes (--pool-teachers, 2; teacher.procs) in a third job;
//                    run only where the machine has a core for each of the S + K
//                    processes (else a line says it was skipped and why)
//
// teacher_cache runs in a second job (the cache is a setting of the teacher
// process) with its own student_only rounds interleaved, and its ratio is to
// that job's student_only; teacher_pool likewise in a third (S students all
// stepping together, student rank 0 reports).
// One student + the teacher process, one torch thread each: on a 2-core
// machine, a core each. Prints JSON lines:
//   {"bench":"e2e","job":"teacher|cache","mode":"student_only|teacher_process|in_process|teacher_cache",
//    "step_ms_p50":…,"tokens_per_s":…,…}
//   {"bench":"e2e","summary":…,"teacher_process_vs_student_only":…,"teacher_process_vs_in_process":…}
//   {"bench":"e2e","summary":…,"teacher_cache_vs_student_only":…,"target_vs_student_only":1.08,…}
//
//   build/bin/bench_e2e [--config configs/demo.yaml] [--steps 30] [--warmup 5] [--rounds 3]
//                       [--jobs teacher,cache,pool] [--pool-students 2] [--pool-teachers 2]
//                       [--set section.key=value]...
//
// It starts itself under distill-run (bin/distill-run, nproc 2) with a teacher
// of the config's teacher architecture and random weights (timing does not
// depend on the weights' values), and prints what the student measured.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <distill/distill.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "data.h"
#include "demo_support.h"
#include "gpt.h"

namespace ex = distill::examples;
using SteadyClock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string config = "configs/demo.yaml";
  std::vector<std::string> sets;
  int steps = 30, warmup = 5, rounds = 3, timeoutS = 600;
  std::string inner; // the student's output file: set when running under distill-run
  std::string job = "teacher"; // inner: "teacher" (student_only, teacher_process, in_process), "cache" or "pool"
  std::string jobs = "teacher,cache,pool"; // outer: the jobs to run
  int poolStudents = 2, poolTeachers = 2;
};

Args parseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--config")
      a.config = value();
    else if (f == "--set")
      a.sets.push_back(value());
    else if (f == "--steps")
      a.steps = std::stoi(value());
    else if (f == "--warmup")
      a.warmup = std::stoi(value());
    else if (f == "--rounds")
      a.rounds = std::stoi(value());
    else if (f == "--timeout-s")
      a.timeoutS = std::stoi(value());
    else if (f == "--inner")
      a.inner = value();
    else if (f == "--job")
      a.job = value();
    else if (f == "--jobs")
      a.jobs = value();
    else if (f == "--pool-students")
      a.poolStudents = std::stoi(value());
    else if (f == "--pool-teachers")
      a.poolTeachers = std::stoi(value());
    else
      throw std::runtime_error("unknown option " + f +
                               "; usage: bench_e2e [--config F] [--steps N] [--warmup N] [--rounds N] "
                               "[--timeout-s S] [--jobs teacher,cache,pool] [--pool-students S] [--pool-teachers K] "
                               "[--set k=v]...");
  }
  if (a.steps < 1 || a.rounds < 1 || a.warmup < 0) throw std::runtime_error("--steps, --rounds >= 1, --warmup >= 0");
  if (a.poolStudents < 1 || a.poolTeachers < 1 || a.poolTeachers > a.poolStudents)
    throw std::runtime_error("--pool-students >= 1, 1 <= --pool-teachers <= --pool-students");
  return a;
}

std::string exeDir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  std::string s(buf);
  return s.substr(0, s.rfind('/'));
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

// ---- the student, under distill-run ----

int inner(const Args& a, int argc, char** argv) {
  distill::Session s = distill::init(argc, argv);
  DISTILL_CHECK_T(ConfigError, !s.isTeacher(), "bench_e2e serves no teacher itself");
  const distill::Config& cfg = s.config;
  const ex::Settings st = ex::Settings::fromConfig(cfg);
  torch::set_num_threads(1);
  auto& group = s.student->group();
  ex::TextData data(st.data, st.valFraction, st.student.context);

  torch::manual_seed(cfg.run.seed);
  ex::Gpt model(st.student);
  model->train();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(st.lr).betas({0.9, 0.95}));
  std::vector<at::Tensor> params = model->parameters();
  ex::Gpt teacher = ex::loadGpt(cfg.teacher.weights); // the in-process baseline's copy of the teacher

  // What the server sends for these logits (full, or its top-k output), for in_process.
  auto shapeLikeServer = [&](const at::Tensor& logits) {
    distill::TeacherOutput o;
    if (cfg.teacher.topk == 0) {
      o.makeLogits().logits = logits;
      return o;
    }
    auto out = distill::topkOutput(logits, cfg.teacher.topk, cfg.loss.temperature);
    o.makeTopk().values = out.at(distill::protocol::kTopkValues);
    o.makeTopk().indices = out.at(distill::protocol::kTopkIndices);
    o.makeTopk().logsumexp = out.at(distill::protocol::kLogsumexp);
    o.makeTopk().logTail = out.at(distill::protocol::kLogTail);
    return o;
  };

  enum Mode { kStudentOnly, kTeacherProcess, kInProcess, kTeacherCache, kTeacherPool };
  const char* names[] = {"student_only", "teacher_process", "in_process", "teacher_cache", "teacher_pool"};
  const bool cacheJob = a.job == "cache", poolJob = a.job == "pool";
  const std::vector<Mode> modes = cacheJob ? std::vector<Mode>{kStudentOnly, kTeacherCache}
      : poolJob                            ? std::vector<Mode>{kStudentOnly, kTeacherPool}
                                           : std::vector<Mode>{kStudentOnly, kTeacherProcess, kInProcess};
  auto viaTeacher = [](Mode m) { return m == kTeacherProcess || m == kTeacherCache || m == kTeacherPool; };
  std::vector<double> times[5], teacherMs;
  int64_t tag = 0; // request tags only ever advance
  int64_t dataStep = 0;
  const double tokens = static_cast<double>(st.batch * st.student.context);

  auto step = [&](Mode m, const ex::Batch& b, std::optional<distill::Handle>& inFlight, const ex::Batch* next) -> void {
    at::Tensor logits = model->forward(b.ids);
    at::Tensor loss;
    if (m == kStudentOnly) {
      loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), b.labels.reshape({-1}));
    } else if (viaTeacher(m)) {
      const distill::Handle h = *inFlight;
      inFlight.reset();
      if (next) inFlight = s.client->submit(next->ids, ++tag, 0);
      distill::TeacherReply reply = s.client->get(h, distill::ReplyMode::kView); // read in place
      loss = distill::distillLoss(logits, b.labels, reply.output(), cfg.loss, tokens).loss;
    } else {
      const auto t0 = SteadyClock::now();
      at::Tensor tl;
      {
        c10::InferenceMode guard;
        tl = teacher->forward(b.ids);
      }
      teacherMs.push_back(std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count());
      loss = distill::distillLoss(logits, b.labels, shapeLikeServer(tl), cfg.loss, tokens).loss;
    }
    loss.backward();
    distill::allReduceGradients(group, params, cfg.student.bucket_mb);
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    opt.step();
    opt.zero_grad();
  };

  // One pass over `batches` in mode m (the teacher modes keep one micro-batch in flight).
  auto pass = [&](Mode m, const std::vector<ex::Batch>& batches, bool timed) {
    const int n = static_cast<int>(batches.size());
    std::optional<distill::Handle> inFlight;
    if (viaTeacher(m)) inFlight = s.client->submit(batches[0].ids, ++tag, 0);
    for (int i = 0; i < n; ++i) {
      const auto t0 = SteadyClock::now();
      step(m, batches[i], inFlight, i + 1 < n ? &batches[i + 1] : nullptr);
      const double ms = std::chrono::duration<double, std::milli>(SteadyClock::now() - t0).count();
      if (timed && i >= a.warmup) times[m].push_back(ms);
    }
  };
  for (int round = 0; round < a.rounds; ++round) {
    for (Mode m : modes) {
      const int n = a.warmup + a.steps;
      std::vector<ex::Batch> batches;
      for (int i = 0; i < n; ++i) batches.push_back(data.sample(cfg.run.seed, ++dataStep, group.rank(), 0, st.batch));
      if (m == kTeacherCache) pass(m, batches, false); // fills the cache with these rows
      pass(m, batches, true);
    }
  }
  s.client->finish();
  if (group.rank() != 0) return 0; // the students stepped together: rank 0 reports

  std::ofstream out(a.inner);
  double p50[5] = {0, 0, 0, 0, 0};
  for (Mode m : modes) p50[m] = percentile(times[m], 0.5);
  for (Mode m : modes) {
    ex::JsonLine l;
    l.add("bench", "e2e")
        .add("job", a.job)
        .add("mode", names[m])
        .add("step_ms_p50", p50[m])
        .add("step_ms_p10", percentile(times[m], 0.1))
        .add("step_ms_p90", percentile(times[m], 0.9))
        .add("tokens_per_s", tokens / (p50[m] / 1000))
        .add("steps", static_cast<int64_t>(times[m].size()))
        .add("ratio_to_student_only", p50[m] / p50[kStudentOnly]);
    if (m == kInProcess) l.add("teacher_forward_ms_p50", percentile(teacherMs, 0.5));
    if (poolJob) l.add("students", group.size()).add("teachers", cfg.teacher.procs);
    out << l.str() << "\n";
  }
  if (poolJob) {
    out << ex::JsonLine()
               .add("bench", "e2e")
               .add("summary", "ratios of step_ms_p50, pool job")
               .add("teacher_pool_vs_student_only", p50[kTeacherPool] / p50[kStudentOnly])
               .add("students", group.size())
               .add("teachers", cfg.teacher.procs)
               .add("rounds", a.rounds)
               .str()
        << "\n";
    return out.good() ? 0 : 1;
  }
  if (cacheJob) {
    const double vs = p50[kTeacherCache] / p50[kStudentOnly];
    out << ex::JsonLine()
               .add("bench", "e2e")
               .add("summary", "ratios of step_ms_p50, cache job")
               .add("teacher_cache_vs_student_only", vs)
               .add("target_vs_student_only", 1.08)
               .add("met", vs <= 1.08 ? "yes" : "no")
               .add("rounds", a.rounds)
               .str()
        << "\n";
    return out.good() ? 0 : 1;
  }
  const double vsStudent = p50[kTeacherProcess] / p50[kStudentOnly];
  const double vsInProcess = p50[kTeacherProcess] / p50[kInProcess];
  out << ex::JsonLine()
             .add("bench", "e2e")
             .add("summary", "ratios of step_ms_p50")
             .add("teacher_process_vs_student_only", vsStudent)
             .add("teacher_process_vs_in_process", vsInProcess)
             .add("target_vs_student_only", 1.10)
             .add("met", vsStudent <= 1.10 && vsInProcess < 1.0 ? "yes" : "no")
             .add("student", st.student.describe())
             .add("teacher", ex::readGptOptions(cfg.teacher.weights).describe())
             .add("tokens_per_step", static_cast<int64_t>(tokens))
             .add("topk", cfg.teacher.topk)
             .add("rounds", a.rounds)
             .add("threads_per_process", 1)
             .str()
      << "\n";
  return out.good() ? 0 : 1;
}

// ---- the outer process: set up, start the job, print its results ----

// One distill-run job of the bench; returns what its student wrote ("" on failure).
std::string runJob(const Args& a, const std::string& dir, const std::string& weights, const std::string& job,
                   const std::vector<std::string>& extraSets, int nproc = 2) {
  const std::string results = dir + "/results-" + job + ".jsonl";
  const std::string bin = exeDir();
  std::vector<std::string> argv = {bin + "/distill-run", "--config", a.config, "--log-dir", dir + "/logs-" + job};
  for (const auto& s : a.sets) argv.insert(argv.end(), {"--set", s});
  argv.insert(argv.end(), {"--set", "run.nproc_per_node=" + std::to_string(nproc)});
  for (const std::string s : {"teacher.kind=registered", "teacher.module=gpt", "teacher.threads=1",
                              "checkpoint.dir=\"\"", "student.in_flight=2"}) {
    argv.insert(argv.end(), {"--set", s});
  }
  for (const auto& s : extraSets) argv.insert(argv.end(), {"--set", s});
  argv.insert(
      argv.end(),
      {"--set", "teacher.weights=" + weights, "--set", "teacher.library=" + bin + "/../lib/libdistill_gpt_teacher.so",
       "--", bin + "/bench_e2e", "--inner", results, "--job", job, "--steps", std::to_string(a.steps), "--warmup",
       std::to_string(a.warmup), "--rounds", std::to_string(a.rounds)});
  std::vector<char*> cargv;
  for (auto& s : argv) cargv.push_back(const_cast<char*>(s.c_str()));
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  DISTILL_CHECK(pid >= 0, "fork: ", distill::errnoString(errno));
  if (pid == 0) {
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::dup2(STDERR_FILENO, STDOUT_FILENO); // the job's console on stderr; stdout is for the JSON
    ::execv(cargv[0], cargv.data());
    std::fprintf(stderr, "bench_e2e: cannot exec %s: %s\n", cargv[0], std::strerror(errno));
    ::_exit(127);
  }
  // Wait with a deadline: poll a pidfd.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  DISTILL_CHECK(pidfd >= 0, "pidfd_open: ", distill::errnoString(errno));
  pollfd p{pidfd, POLLIN, 0};
  int rc;
  while ((rc = ::poll(&p, 1, a.timeoutS * 1000)) < 0 && errno == EINTR) {
  }
  if (rc == 0) {
    ::kill(pid, SIGTERM); // distill-run tears its job down
    std::fprintf(stderr, "bench_e2e: distill-run (%s job) still running after %d s: stopped\n", job.c_str(),
                 a.timeoutS);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(pidfd);
  const std::string text = ex::readText(results);
  const bool ok = rc > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 && !text.empty();
  if (!ok) std::fprintf(stderr, "bench_e2e: the %s job failed (distill-run status %d)\n", job.c_str(), status);
  return ok ? text : std::string();
}

int outer(const Args& a) {
  const distill::Config cfg = distill::loadConfig(a.config, a.sets);
  const ex::Settings st = ex::Settings::fromConfig(cfg);
  char tmpl[] = "/tmp/distill-bench-e2e-XXXXXX";
  DISTILL_CHECK(::mkdtemp(tmpl) != nullptr, "mkdtemp: ", distill::errnoString(errno));
  const std::string dir = tmpl;
  const std::string weights = dir + "/teacher.pt";
  {
    torch::manual_seed(cfg.run.seed + 7);
    ex::GptOptions t = st.teacher;
    t.dropout = 0;
    ex::Gpt teacher(t);
    ex::saveGpt(teacher, weights);
  }
  auto wanted = [&](const std::string& job) { return ("," + a.jobs + ",").find("," + job + ",") != std::string::npos; };
  bool ok = true;
  auto run = [&](const std::string& job, const std::vector<std::string>& sets, int nproc) {
    const std::string out = runJob(a, dir, weights, job, sets, nproc);
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
    ok = ok && !out.empty();
  };
  if (wanted("teacher")) run("teacher", {}, 2);
  if (ok && wanted("cache")) run("cache", {"teacher.cache.mode=readwrite", "teacher.cache.path=" + dir + "/cache"}, 2);
  const int procs = a.poolStudents + a.poolTeachers;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (ok && wanted("pool") && procs > cores) {
    // Timing S + K busy processes on fewer cores measures the scheduler, not the pool.
    std::printf("%s\n",
                ex::JsonLine()
                    .add("bench", "e2e")
                    .add("job", "pool")
                    .add("mode", "teacher_pool")
                    .add("skipped",
                         "needs a core for each of its " + std::to_string(procs) +
                             " processes (students + teachers), this machine has " + std::to_string(cores))
                    .str()
                    .c_str());
  } else if (ok && wanted("pool")) {
    run("pool", {"teacher.procs=" + std::to_string(a.poolTeachers)}, procs);
  }
  ex::removeTree(dir);
  return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  try {
    Args a = parseArgs(argc, argv);
    if (!a.inner.empty()) {
      char* args[] = {argv[0], nullptr}; // distill::init must not see the bench's own options
      return inner(a, 1, args);
    }
    return outer(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_e2e: %s\n", e.what());
    return 1;
  }
}
