// bench_loss: forward + backward time of distillLoss against plain
// cross-entropy (the label-only trainer's loss) on the same logits, measured in
// the same run, one torch thread. Prints JSON lines:
//   {"bench":"loss","kind":"forward_kl","teacher":"full|top32","dtype":"float32","n":1024,"v":256,
//    "ms_p50":…,"ce_ms_p50":…,"ratio_to_ce":…,"cpu_ms_p50":…,"ce_cpu_ms_p50":…,"cpu_ratio_to_ce":…}
// ms: wall time; cpu_ms: this thread's CPU time (what counts on a shared machine).
//
//   build/bin/bench_loss [--n 1024] [--v 256] [--reps 200] [--no-tail] [--double] [--kind K]
//
// --double: float64 logits (both losses); --kind: only that kind.
// top32 is what the teacher server sends (topkOutput: values, indices,
// logsumexp and log tail); --no-tail leaves the log tail out (an older
// teacher: the logsumexp-only path).
#include <distill/distill.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

namespace {

double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double threadCpuMs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// Medians of wall time and of this thread's CPU time per call. With one torch
// thread the CPU time is the work itself; on a loaded machine the wall time
// also counts the time slices other processes took, so compare CPU times there.
struct Timing {
  double wall = 0, cpu = 0;
};

template <typename F>
Timing timeMs(int reps, F&& f) {
  std::vector<double> wall, cpu;
  for (int i = 0; i < reps + 10; ++i) {
    const double c0 = threadCpuMs();
    auto t0 = std::chrono::steady_clock::now();
    f();
    auto t1 = std::chrono::steady_clock::now();
    const double c1 = threadCpuMs();
    if (i >= 10) {
      wall.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      cpu.push_back(c1 - c0);
    }
  }
  return {p50(wall), p50(cpu)};
}

} // namespace

int main(int argc, char** argv) {
  int64_t n = 1024, v = 256;
  int reps = 200;
  bool noTail = false, dbl = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--no-tail")
      noTail = true;
    else if (f == "--double")
      dbl = true;
    else if (f == "--kind" && i + 1 < argc)
      only = argv[++i];
    else if (f == "--n" && i + 1 < argc)
      n = std::stoll(argv[++i]);
    else if (f == "--v" && i + 1 < argc)
      v = std::stoll(argv[++i]);
    else if (f == "--reps" && i + 1 < argc)
      reps = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_loss [--n N] [--v V] [--reps R] [--no-tail] [--double] [--kind K]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  torch::manual_seed(0);
  const auto dtype = dbl ? torch::kDouble : torch::kFloat;
  auto base = torch::randn({n, v}, dtype);
  auto teacher = torch::randn({n, v}, dtype) * 2;
  auto labels = torch::randint(0, v, {n}, torch::kLong);
  const Timing ce = timeMs(reps, [&] {
    auto z = base.clone().requires_grad_(true);
    torch::nn::functional::cross_entropy(z, labels).backward();
  });
  for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
    if (!only.empty() && only != kind) continue;
    for (bool topk : {false, true}) {
      if (topk && std::string(kind) == "reverse_kl") continue;
      distill::LossOptions o;
      o.kind = distill::parseEnum<distill::LossKind>(kind).value();
      o.temperature = 1.0;
      distill::TeacherOutput t;
      if (topk) { // what the teacher server sends: values, indices, logsumexp, log tail
        auto out = distill::topkOutput(teacher, 32, o.temperature);
        t.topkValues = out.at(distill::protocol::kTopkValues);
        t.topkIndices = out.at(distill::protocol::kTopkIndices);
        t.logsumexp = out.at(distill::protocol::kLogsumexp);
        if (!noTail) t.logTail = out.at(distill::protocol::kLogTail);
      } else {
        t.logits = teacher;
      }
      const Timing ms = timeMs(reps, [&] {
        auto z = base.clone().requires_grad_(true);
        distill::distillLoss(z, labels, t, o, static_cast<double>(n)).loss.backward();
      });
      std::printf(
          "{\"bench\":\"loss\",\"kind\":\"%s\",\"teacher\":\"%s\",\"dtype\":\"%s\",\"n\":%lld,"
          "\"v\":%lld,\"ms_p50\":%.3f,\"ce_ms_p50\":%.3f,\"ratio_to_ce\":%.2f,\"cpu_ms_p50\":%.3f,"
          "\"ce_cpu_ms_p50\":%.3f,\"cpu_ratio_to_ce\":%.2f}\n",
          kind, topk ? "top32" : "full", dbl ? "float64" : "float32", static_cast<long long>(n),
          static_cast<long long>(v), ms.wall, ce.wall, ms.wall / ce.wall, ms.cpu, ce.cpu, ms.cpu / ce.cpu);
    }
  }
  return 0;
}
