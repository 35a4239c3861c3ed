// bench_ring_cuda: the rings' CUDA IPC path against cudaMemcpy device-to-device,
// both measured in one run on one GPU. The teacher side runs in this process,
// the student side in a second process (this binary re-executed with
// DISTILL_BENCH_ROLE=student: never fork once CUDA is in play). Prints one JSON
// object per line, then a line of ratios:
//
//   path d2d     op oneway     at::Tensor::copy_ device to device into 2 rotating buffers (the bound)
//   path cudaipc op oneway     student send() of a CUDA tensor (one device copy into the slot's
//                              CUDA IPC buffer) -> teacher view() + stream sync + release
//   path cudaipc op roundtrip  64 B / 4 KiB CUDA tensor: student send -> teacher reply -> student view + sync
//
//   build/bin/bench_ring_cuda [--max-mib 1024]
//
// Exits 2 (with a message) when no CUDA device is visible.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/ipc/channel.h"
#include "distill/ipc/segment.h"

extern char** environ;

using namespace distill;
using namespace distill::ipc;
using namespace std::chrono_literals;

namespace {

const std::string kJob = "bench-ring-cuda";
constexpr int kSlots = 2;
const std::vector<int64_t> kRoundTripSizes = {64, 4 << 10};
constexpr int kRoundTrips = 2000;

std::vector<int64_t> oneWaySizes(int64_t maxBytes) {
  std::vector<int64_t> s;
  for (int64_t b = int64_t(1) << 20; b <= maxBytes; b *= 4) s.push_back(b);
  return s;
}

int64_t iterationsFor(int64_t bytes) { return std::clamp<int64_t>((int64_t(16) << 30) / bytes, 8, 2000); }

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

EndpointOptions cudaOpts(int rank) {
  EndpointOptions o;
  o.rank = rank;
  o.cudaIpc = CudaIpc::kOn;
  o.cudaDevice = 0;
  return o;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_ring_cuda: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

at::TensorOptions onGpu(at::ScalarType t) { return at::TensorOptions().device(at::kCUDA, 0).dtype(t); }

// ---- the student process ------------------------------------------------------------------------------

int studentMain(const std::string& seg, int64_t maxBytes) {
  auto s = Segment::attach(seg, kJob, std::nullopt, Deadline::after(60s));
  StudentEndpoint st(s, 0, cudaOpts(0));
  st.waitAdmission(Deadline::after(60s));
  uint64_t seq = 0;
  for (int64_t bytes : oneWaySizes(maxBytes)) {
    auto src = at::ones({bytes / 4}, onGpu(at::kFloat)) /* 4-byte elements: a dtype the wire carries */;
    for (int64_t i = 0; i < iterationsFor(bytes) + kSlots * 2; ++i) {
      OutMessage m;
      m.tag = Tag{seq++, 0, 0};
      m.tensors.push_back({"x", src});
      st.send(m, Deadline::after(120s));
    }
  }
  for (int64_t bytes : kRoundTripSizes) {
    auto x = at::ones({bytes / 4}, onGpu(at::kFloat)) /* 4-byte elements: a dtype the wire carries */;
    for (int i = -100; i < kRoundTrips; ++i) {
      OutMessage m;
      m.tag = Tag{seq++, 0, 0};
      m.tensors.push_back({"x", x});
      const auto t0 = Clock::now();
      st.send(m, Deadline::after(30s));
      auto r = st.receive(Deadline::after(30s));
      (void)r.view("y");
      check(cudaStreamSynchronize(nullptr), "stream sync");
      r.release();
      if (i >= 0) std::printf("%.3f\n", seconds(Clock::now() - t0) * 1e6); // parsed by the parent
    }
  }
  OutMessage fin;
  fin.kind = MsgKind::kFinish;
  st.send(fin, Deadline::after(30s));
  return 0;
}

// ---- the teacher side and the baseline (this process) ----------------------------------------------------

std::map<std::string, double> gResults;

void printOneWay(const char* path, int64_t bytes, double gbps) {
  std::printf("{\"bench\":\"ring_cuda\",\"path\":\"%s\",\"op\":\"oneway\",\"bytes\":%ld,\"GBps\":%.3f}\n", path,
              long(bytes), gbps);
  std::fflush(stdout);
  gResults[std::string(path) + "/" + std::to_string(bytes)] = gbps;
}

void benchD2D(int64_t maxBytes) {
  for (int64_t bytes : oneWaySizes(maxBytes)) {
    auto src = at::ones({bytes / 4}, onGpu(at::kFloat)) /* 4-byte elements: a dtype the wire carries */;
    std::vector<at::Tensor> dst{at::empty_like(src), at::empty_like(src)};
    for (auto& d : dst) d.copy_(src);
    check(cudaDeviceSynchronize(), "sync");
    const int64_t n = iterationsFor(bytes);
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) dst[size_t(i % 2)].copy_(src);
    check(cudaDeviceSynchronize(), "sync");
    printOneWay("d2d", bytes, double(bytes) * double(n) / seconds(Clock::now() - t0) / 1e9);
  }
}

pid_t spawnStudent(const std::string& seg, const std::string& maxMib, const std::string& outFile) {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return -1;
  exe[n] = 0;
  const std::string role = "DISTILL_BENCH_ROLE=student", segVar = "DISTILL_BENCH_SEGMENT=" + seg;
  std::vector<char*> env;
  for (char** e = environ; *e; ++e) env.push_back(*e);
  env.push_back(const_cast<char*>(role.c_str()));
  env.push_back(const_cast<char*>(segVar.c_str()));
  env.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, outFile.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const char* argv[] = {exe, "--max-mib", maxMib.c_str(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe, &fa, nullptr, const_cast<char**>(argv), env.data());
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

void printRoundTrips(const std::string& file) {
  std::vector<double> us;
  if (FILE* f = std::fopen(file.c_str(), "r")) {
    double v;
    while (std::fscanf(f, "%lf", &v) == 1) us.push_back(v);
    std::fclose(f);
  }
  for (size_t part = 0; part < kRoundTripSizes.size(); ++part) {
    const size_t lo = part * kRoundTrips, hi = lo + kRoundTrips;
    if (us.size() < hi) return;
    std::vector<double> v(us.begin() + long(lo), us.begin() + long(hi));
    std::sort(v.begin(), v.end());
    const double p50 = v[v.size() / 2], p99 = v[v.size() * 99 / 100];
    std::printf(
        "{\"bench\":\"ring_cuda\",\"path\":\"cudaipc\",\"op\":\"roundtrip\",\"bytes\":%ld,\"p50_us\":%.2f,"
        "\"p99_us\":%.2f}\n",
        long(kRoundTripSizes[part]), p50, p99);
    gResults["rt/" + std::to_string(kRoundTripSizes[part])] = p50;
  }
}

} // namespace

int main(int argc, char** argv) {
  int64_t maxMib = 1024;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--max-mib") == 0 && i + 1 < argc) {
      maxMib = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_ring_cuda [--max-mib N]\n");
      return 2;
    }
  }
  if (maxMib < 1) {
    std::fprintf(stderr, "bench_ring_cuda: --max-mib must be >= 1\n");
    return 2;
  }
  const int64_t maxBytes = maxMib << 20;
  if (const char* role = std::getenv("DISTILL_BENCH_ROLE"); role && std::strcmp(role, "student") == 0) {
    try {
      return studentMain(std::getenv("DISTILL_BENCH_SEGMENT"), maxBytes);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_ring_cuda student: %s\n", e.what());
      return 1;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_ring_cuda: no CUDA device visible\n");
    return 2;
  }
  const auto start = Clock::now();
  const std::string name = "distill-bench-cuda-" + std::to_string(::getpid());
  const std::string rtFile = "/tmp/" + name + ".rt";
  SegmentLayout l;
  l.numStudents = 1;
  l.slots = kSlots;
  l.maxRequestBytes = maxBytes;
  l.maxResponseBytes = 64 << 10;
  auto seg = Segment::create(name, l, kJob);
  const pid_t child = spawnStudent(name, std::to_string(maxMib), rtFile);
  if (child < 0) {
    std::fprintf(stderr, "bench_ring_cuda: cannot start the student process\n");
    Segment::remove(name);
    return 1;
  }
  int rc = 0;
  try {
    TeacherEndpoint t(seg, cudaOpts(1));
    t.waitAdmission(Deadline::after(60s));
    for (int64_t bytes : oneWaySizes(maxBytes)) {
      const int64_t n = iterationsFor(bytes);
      auto take = [&] {
        auto m = t.waitAny(Deadline::after(120s));
        (void)m.view("x");
        check(cudaStreamSynchronize(nullptr), "stream sync");
        m.release();
      };
      for (int i = 0; i < kSlots * 2; ++i) take();
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < n; ++i) take();
      printOneWay("cudaipc", bytes, double(bytes) * double(n) / seconds(Clock::now() - t0) / 1e9);
    }
    for (;;) { // the round trips: echo
      auto m = t.waitAny(Deadline::after(60s));
      if (m.kind() == MsgKind::kFinish) break;
      OutMessage r;
      r.tag = m.tag();
      r.kind = MsgKind::kResponse;
      r.tensors.push_back({"y", m.view("x")});
      t.reply(m.student(), r, Deadline::after(30s));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ring_cuda teacher: %s\n", e.what());
    rc = 1;
  }
  int st = 0;
  while (::waitpid(child, &st, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  Segment::remove(name);
  printRoundTrips(rtFile);
  std::remove(rtFile.c_str());
  benchD2D(maxBytes);
  auto r = [](const std::string& k) { return gResults.count(k) ? gResults[k] : 0.0; };
  std::string ratios;
  for (int64_t b : oneWaySizes(maxBytes)) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "\"cudaipc_over_d2d_%ldMiB\":%.3f,", long(b >> 20),
                  r("cudaipc/" + std::to_string(b)) / r("d2d/" + std::to_string(b)));
    ratios += buf;
  }
  std::printf("{\"bench\":\"ring_cuda\",\"ratios\":{%s\"roundtrip_p50_us_64B\":%.2f,\"total_s\":%.1f}}\n",
              ratios.c_str(), r("rt/64"), seconds(Clock::now() - start));
  return rc;
}
