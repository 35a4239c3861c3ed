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
//
//   build/bin/bench_loss --signals [--n 128] [--v 32000] [--draws 100] [--reps 5] [--teacher-logits FILE]
//
// --signals: bytes per token, CPU time and gradient bias of each teacher signal
// (full, top-k, the student's top-k, sampled targets, the sampled token;
// bench/signals.cpp says how).
//
//   build/bin/bench_loss --linear [--n 4096] [--d 512] [--v 32000] [--topk 64] [--reps 3] [--threads 1] [--kind K]
//                                 [--teacher full|top|hidden]
//
// --linear: fusedLinearLoss (hidden [N, d], weight [V, d]) against (a) distillLoss
// on the materialised logits hidden @ weight.T (autograd through the matmul) and
// (b) a fused linear cross-entropy written the same way (the same chunks of
// matmuls, cross-entropy and its gradient in place: the label-only baseline),
// forward + backward, all three interleaved per repetition, per kind and teacher
// (full logits, top-k with logsumexp and log tail, and hidden states: the
// teacher's final hidden states [N, d] and its head [V, d], hidden_head.h, whose
// unfused path is teacherLogits (the teacher's [N, V] logits) then (a); --teacher
// runs one form only). Prints JSON lines:
//   {"bench":"fused_linear","kind":…,"teacher":"full|top64|hidden","n":…,"d":…,"v":…,"threads":…,
//    "ms_p50":…,"unfused_ms_p50":…,"ce_ms_p50":…,"ratio_to_ce":…,"ratio_to_unfused":…,
//    "peak_mib":…,"unfused_peak_mib":…,"ce_peak_mib":…,"peak_ratio_to_unfused":…}
// ms: wall time (process CPU time in cpu_*). Peak memory: the most bytes of CPU
// tensor storage alive at once during the call beyond its inputs (hidden,
// weight, teacher output or hidden states and head, labels), gradients included, counted by a wrapping
// CPU allocator (tests/loss/counting_allocator.h); GEMM workspaces that
// oneDNN/MKL take with malloc are not seen (the same for all three paths).
// top32 is what the teacher server sends (topkOutput: values, indices,
// logsumexp and log tail); --no-tail leaves the log tail out (an older
// teacher: the logsumexp-only path).
#include <distill/distill.h>
#include <torch/torch.h>

#include "counting_allocator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
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

// ---- --linear ----------------------------------------------------------------

double processCpuMs() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// One path's numbers: medians over the repetitions, and the peak.
struct Path {
  std::vector<double> wall, cpu;
  double peakMib = 0;
  template <typename F>
  void run(F&& f) {
    auto& a = distill::counting();
    const int64_t base = a.live();
    a.resetPeak();
    const double c0 = processCpuMs();
    auto t0 = std::chrono::steady_clock::now();
    f();
    auto t1 = std::chrono::steady_clock::now();
    cpu.push_back(processCpuMs() - c0);
    wall.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    peakMib = std::max(peakMib, (a.peak() - base) / 1048576.0);
  }
};

struct LinearSetup {
  int64_t n = 4096, d = 512, v = 32000, topk = 64;
  int reps = 3, threads = 1;
  std::string only, teacher; // one kind, one teacher form (full | top | hidden); empty: all
};

// (b): chunked matmul + cross-entropy, its gradient formed in place in the
// chunk's logits and turned into the hidden states' and the weight's at once;
// the same chunks as fusedLinearLoss's automatic ones.
void fusedLinearCe(const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels) {
  const int64_t n = h.size(0), v = w.size(0);
  const int64_t chunk = std::max<int64_t>(256, (int64_t{1} << 23) / v);
  at::Tensor gh = at::empty_like(h), gw = at::zeros_like(w);
  double loss = 0;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t c = std::min(chunk, n - c0);
    at::Tensor hc = h.narrow(0, c0, c), lab = labels.narrow(0, c0, c).unsqueeze(1);
    at::Tensor z = at::mm(hc, w.t());
    at::Tensor lse = at::logsumexp(z, 1, /*keepdim=*/true);
    loss += (lse - z.gather(1, lab)).sum().item<double>();
    at::Tensor g = z.sub_(lse).exp_(); // softmax, in place
    g.scatter_add_(1, lab, at::full({c, 1}, -1.0, g.options())).mul_(1.0 / n);
    at::Tensor rows = gh.narrow(0, c0, c);
    at::mm_out(rows, g, w);
    gw.addmm_(g.t(), hc);
  }
  (void)loss;
}

void printLinearRow(const LinearSetup& s, const char* kind, const std::string& teacher, const Path& fused,
                    const Path& unfused, const Path& ce) {
  const double f = p50(fused.wall), u = p50(unfused.wall), c = p50(ce.wall);
  std::printf(
      "{\"bench\":\"fused_linear\",\"kind\":\"%s\",\"teacher\":\"%s\",\"dtype\":\"float32\",\"n\":%lld,"
      "\"d\":%lld,\"v\":%lld,\"threads\":%d,\"reps\":%d,\"ms_p50\":%.1f,\"unfused_ms_p50\":%.1f,"
      "\"ce_ms_p50\":%.1f,\"ratio_to_ce\":%.3f,\"ratio_to_unfused\":%.3f,\"cpu_ms_p50\":%.1f,"
      "\"unfused_cpu_ms_p50\":%.1f,\"ce_cpu_ms_p50\":%.1f,\"cpu_ratio_to_ce\":%.3f,\"peak_mib\":%.1f,"
      "\"unfused_peak_mib\":%.1f,\"ce_peak_mib\":%.1f,\"peak_ratio_to_unfused\":%.3f}\n",
      kind, teacher.c_str(), static_cast<long long>(s.n), static_cast<long long>(s.d), static_cast<long long>(s.v),
      s.threads, s.reps, f, u, c, f / c, f / u, p50(fused.cpu), p50(unfused.cpu), p50(ce.cpu),
      p50(fused.cpu) / p50(ce.cpu), fused.peakMib, unfused.peakMib, ce.peakMib, fused.peakMib / unfused.peakMib);
  std::fflush(stdout);
}

void benchLinearConfig(const LinearSetup& s, const char* kind, bool topk, const at::Tensor& h0, const at::Tensor& w0,
                       const at::Tensor& teacherLogits, const at::Tensor& labels) {
  distill::LossOptions o;
  o.kind = distill::parseEnum<distill::LossKind>(kind).value();
  distill::TeacherOutput t;
  if (topk) {
    auto out = distill::topkOutput(teacherLogits, s.topk, o.temperature);
    t.makeTopk().values = out.at(distill::protocol::kTopkValues);
    t.makeTopk().indices = out.at(distill::protocol::kTopkIndices);
    t.makeTopk().logsumexp = out.at(distill::protocol::kLogsumexp);
    t.makeTopk().logTail = out.at(distill::protocol::kLogTail);
  } else {
    t.makeLogits().logits = teacherLogits;
  }
  at::Tensor h = h0.detach().requires_grad_(true), w = w0.detach().requires_grad_(true);
  const double norm = static_cast<double>(s.n);
  Path fused, unfused, ce;
  for (int r = 0; r < s.reps; ++r) {
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    fused.run([&] { distill::fusedLinearLoss(h, w, at::Tensor(), labels, t, o, norm).loss.backward(); });
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    unfused.run([&] { distill::distillLoss(at::mm(h, w.t()), labels, t, o, norm).loss.backward(); });
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    ce.run([&] { fusedLinearCe(h0, w0, labels); });
  }
  printLinearRow(s, kind, topk ? "top" + std::to_string(s.topk) : "full", fused, unfused, ce);
}

// The teacher as hidden states th [N, d] + head: fusedLinearLoss's two heads against teacherLogits then
// distillLoss on the materialised logits, and the fused linear cross-entropy.
void benchHiddenConfig(const LinearSetup& s, const char* kind, const at::Tensor& h0, const at::Tensor& w0,
                       const at::Tensor& th, const distill::TeacherHead& head, const at::Tensor& labels) {
  distill::LossOptions o;
  o.kind = distill::parseEnum<distill::LossKind>(kind).value();
  at::Tensor h = h0.detach().requires_grad_(true), w = w0.detach().requires_grad_(true);
  const double norm = static_cast<double>(s.n);
  Path fused, unfused, ce;
  for (int r = 0; r < s.reps; ++r) {
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    fused.run([&] { distill::fusedLinearLoss(h, w, at::Tensor(), labels, th, head, o, norm).loss.backward(); });
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    unfused.run([&] {
      distill::TeacherOutput t;
      t.makeLogits().logits = distill::teacherLogits(th, head);
      distill::distillLoss(at::mm(h, w.t()), labels, t, o, norm).loss.backward();
    });
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    ce.run([&] { fusedLinearCe(h0, w0, labels); });
  }
  printLinearRow(s, kind, "hidden", fused, unfused, ce);
}

int benchLinear(const LinearSetup& s) {
  c10::SetCPUAllocator(&distill::counting(), /*priority=*/100);
  at::set_num_threads(s.threads);
  torch::manual_seed(0);
  // Hidden states and a projection at the scale of a trained model's (logits ~ N(0, 2^2)).
  at::Tensor h = torch::randn({s.n, s.d});
  at::Tensor w = torch::randn({s.v, s.d}) * (2.0 / std::sqrt(static_cast<double>(s.d)));
  const bool logits = s.teacher.empty() || s.teacher != "hidden";
  at::Tensor teacher = logits ? torch::randn({s.n, s.v}) * 2 : at::Tensor();
  at::Tensor labels = torch::randint(0, s.v, {s.n}, torch::kLong);
  // The teacher as hidden states: its logits at the same scale, N(0, 2^2).
  at::Tensor th = torch::randn({s.n, s.d});
  distill::TeacherHead head;
  head.weight = torch::randn({s.v, s.d}) * (2.0 / std::sqrt(static_cast<double>(s.d)));
  for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
    if (!s.only.empty() && s.only != kind) continue;
    for (const char* form : {"full", "top", "hidden"}) {
      if (!s.teacher.empty() && s.teacher != form) continue;
      if (std::string(form) == "hidden") {
        benchHiddenConfig(s, kind, h, w, th, head, labels);
      } else {
        benchLinearConfig(s, kind, std::string(form) == "top", h, w, teacher, labels);
      }
    }
  }
  return 0;
}

int linearMain(int argc, char** argv) {
  LinearSetup s;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    const bool more = i + 1 < argc;
    if (f == "--linear") continue;
    if (f == "--n" && more) {
      s.n = std::stoll(argv[++i]);
    } else if (f == "--d" && more) {
      s.d = std::stoll(argv[++i]);
    } else if (f == "--v" && more) {
      s.v = std::stoll(argv[++i]);
    } else if (f == "--topk" && more) {
      s.topk = std::stoll(argv[++i]);
    } else if (f == "--reps" && more) {
      s.reps = std::stoi(argv[++i]);
    } else if (f == "--threads" && more) {
      s.threads = std::stoi(argv[++i]);
    } else if (f == "--kind" && more) {
      s.only = argv[++i];
    } else if (f == "--teacher" && more) {
      s.teacher = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: bench_loss --linear [--n N] [--d D] [--v V] [--topk K] [--reps R] [--threads T] "
                   "[--kind K] [--teacher full|top|hidden]\n");
      return 2;
    }
  }
  return benchLinear(s);
}

} // namespace

int signalsMain(int argc, char** argv); // signals.cpp

int main(int argc, char** argv) {
  int64_t n = 1024, v = 256;
  int reps = 200;
  bool noTail = false, dbl = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--linear") return linearMain(argc, argv);
    if (std::string(argv[i]) == "--signals") return signalsMain(argc, argv);
  }
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
        t.makeTopk().values = out.at(distill::protocol::kTopkValues);
        t.makeTopk().indices = out.at(distill::protocol::kTopkIndices);
        t.makeTopk().logsumexp = out.at(distill::protocol::kLogsumexp);
        if (!noTail) t.makeTopk().logTail = out.at(distill::protocol::kLogTail);
      } else {
        t.makeLogits().logits = teacher;
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
