// bench_ring: the shared-memory rings against memcpy and against c10d gloo
// send/recv, all measured in one run, two processes per measurement (fork).
// Prints one JSON object per line, then a line of ratios.
//
//   path memcpy  op oneway     in-process memcpy into K rotating buffers (the bound for "copy")
//   path copy    op oneway     student send() (one memcpy into the slot) -> teacher receive+release
//   path inslot  op oneway     student allocate() in the slot, touch, publish() -> teacher (no copy)
//   path copy    op roundtrip  student send -> teacher reply (copy of the same bytes) -> student
//   path gloo    op roundtrip  rank 0 send -> rank 1 recv + send back -> rank 0 recv (ProcessGroupGloo)
//   path selfloop op roundtrip both endpoints in one thread: the CPU cost of the code alone
//                              (no cross-core traffic, no waiting)
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/ipc/channel.h"
#include "distill/ipc/segment.h"

using namespace distill;
using namespace distill::ipc;
using namespace std::chrono_literals;

namespace {

const std::string kJob = "bench-ring";
constexpr int kSlots = 4;
const std::vector<int64_t> kOneWaySizes = {4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
const std::vector<int64_t> kRoundTripSizes = {64, 1 << 10, 4 << 10, 64 << 10};

std::map<std::string, double> gResults; // for the ratio line

EndpointOptions hostOnly(int rank) {
  EndpointOptions o;
  o.rank = rank;
  o.cudaIpc = distill::CudaIpc::kOff;
  return o;
}

int64_t iterationsFor(int64_t bytes) { return std::clamp<int64_t>((int64_t(1) << 30) / bytes, 16, 20000); }

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void printOneWay(const char* path, int64_t bytes, double gbps) {
  std::printf("{\"bench\":\"ring\",\"path\":\"%s\",\"op\":\"oneway\",\"bytes\":%ld,\"GBps\":%.3f}\n", path, long(bytes),
              gbps);
  std::fflush(stdout);
  gResults[std::string(path) + "/" + std::to_string(bytes)] = gbps;
}

void printRoundTrip(const char* path, int64_t bytes, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  const double p50 = us[us.size() / 2], p99 = us[std::min(us.size() - 1, us.size() * 99 / 100)];
  std::printf(
      "{\"bench\":\"ring\",\"path\":\"%s\",\"op\":\"roundtrip\",\"bytes\":%ld,\"p50_us\":%.2f,\"p99_us\":%.2f}\n", path,
      long(bytes), p50, p99);
  std::fflush(stdout);
  gResults[std::string(path) + "/rt/" + std::to_string(bytes)] = p50;
}

template <typename F>
pid_t forkRun(F f) {
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = f();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench child: %s\n", e.what());
    }
    std::fflush(stdout);
    ::_exit(rc);
  }
  return pid;
}

bool reap(pid_t pid) {
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

std::string segName(const char* what) { return "distill-bench-" + std::to_string(::getpid()) + "-" + what; }

// ---- memcpy baseline -------------------------------------------------------------------------------

void benchMemcpy() {
  for (int64_t bytes : kOneWaySizes) {
    std::vector<char> src(size_t(bytes), 1);
    std::vector<std::vector<char>> dst(kSlots, std::vector<char>(size_t(bytes), 0)); // touched: no page faults
    const int64_t n = iterationsFor(bytes);
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst[size_t(i % kSlots)].data(), src.data(), size_t(bytes));
    const double s = seconds(Clock::now() - t0);
    printOneWay("memcpy", bytes, double(bytes) * double(n) / s / 1e9);
  }
}

// ---- one-way: student (child) produces, teacher (parent) consumes ------------------------------------

void benchOneWay() {
  const std::string name = segName("oneway");
  SegmentLayout l;
  l.numStudents = 1;
  l.slots = kSlots;
  l.maxRequestBytes = kOneWaySizes.back();
  l.maxResponseBytes = 4096;
  auto seg = Segment::create(name, l, kJob);
  constexpr int kWarm = kSlots * 2; // every slot's pages touched before timing
  pid_t child = forkRun([&] {
    auto s2 = Segment::attach(name, kJob, std::nullopt, Deadline::after(10s));
    StudentEndpoint st(s2, 0, hostOnly(0));
    st.waitAdmission(Deadline::after(10s));
    for (const char* mode : {"copy", "inslot"}) {
      for (int64_t bytes : kOneWaySizes) {
        auto src = at::empty({bytes / 4}, at::kFloat);
        std::memset(src.data_ptr(), 1, size_t(bytes));
        const int64_t n = iterationsFor(bytes) + kWarm;
        for (int64_t i = 0; i < n; ++i) {
          Tag tag{uint64_t(i), 0, 0};
          if (mode[0] == 'c') {
            OutMessage m;
            m.tag = tag;
            m.tensors.push_back({"x", src});
            st.send(m, Deadline::after(30s));
          } else {
            auto t = st.allocate(tag, {{"x", at::kFloat, {bytes / 4}}}, Deadline::after(30s));
            static_cast<float*>(t[0].data_ptr())[0] = float(i); // produced in place
            st.publish();
          }
        }
      }
    }
    return 0;
  });
  {
    TeacherEndpoint t(seg, hostOnly(1));
    t.waitAdmission(Deadline::after(10s));
    for (const char* mode : {"copy", "inslot"}) {
      for (int64_t bytes : kOneWaySizes) {
        const int64_t n = iterationsFor(bytes);
        for (int i = 0; i < kWarm; ++i) t.waitAny(Deadline::after(30s)).release();
        const auto t0 = Clock::now();
        for (int64_t i = 0; i < n; ++i) t.waitAny(Deadline::after(30s)).release();
        printOneWay(mode, bytes, double(bytes) * double(n) / seconds(Clock::now() - t0) / 1e9);
      }
    }
  }
  reap(child);
  Segment::remove(name);
}

// ---- round trip: student (parent) -> teacher (child, echo) -> student ------------------------------

void benchRoundTrip() {
  const std::string name = segName("rt");
  SegmentLayout l;
  l.numStudents = 1;
  l.slots = kSlots;
  l.maxRequestBytes = l.maxResponseBytes = 1 << 20;
  auto seg = Segment::create(name, l, kJob);
  pid_t child = forkRun([&] {
    auto s2 = Segment::attach(name, kJob, std::nullopt, Deadline::after(10s));
    TeacherEndpoint t(s2, hostOnly(1));
    t.waitAdmission(Deadline::after(10s));
    for (;;) {
      auto m = t.waitAny(Deadline::after(60s));
      if (m.kind() == MsgKind::kFinish) return 0;
      OutMessage r;
      r.tag = m.tag();
      r.kind = MsgKind::kResponse;
      r.tensors.push_back({"y", m.view("x")});
      t.reply(m.student(), r, Deadline::after(10s));
    }
  });
  {
    StudentEndpoint st(seg, 0, hostOnly(0));
    st.waitAdmission(Deadline::after(10s));
    for (int64_t bytes : kRoundTripSizes) {
      auto x = at::empty({bytes}, at::kBool);
      std::memset(x.data_ptr(), 1, size_t(bytes));
      const int n = bytes <= 4096 ? 20000 : 5000;
      std::vector<double> us;
      us.reserve(size_t(n));
      OutMessage m;
      m.tensors.push_back({"x", x});
      for (int i = -200; i < n; ++i) {
        m.tag.seq = uint64_t(i + 200);
        const auto t0 = Clock::now();
        st.send(m, Deadline::after(10s));
        st.receive(Deadline::after(10s)).release();
        if (i >= 0) us.push_back(seconds(Clock::now() - t0) * 1e6);
      }
      printRoundTrip("copy", bytes, std::move(us));
    }
    OutMessage fin;
    fin.kind = MsgKind::kFinish;
    st.send(fin, Deadline::after(10s));
  }
  reap(child);
  Segment::remove(name);
}

// ---- software cost: both ends in one thread ---------------------------------------------------------
// Student and teacher endpoints of one segment driven from a single thread:
// no cross-core traffic, no waiting, so this is the per-round-trip CPU cost of
// the code itself (headers, validation, tensor views, bookkeeping).
void benchSelfLoop() {
  const std::string name = segName("self");
  SegmentLayout l;
  l.numStudents = 1;
  l.slots = kSlots;
  l.maxRequestBytes = l.maxResponseBytes = 1 << 20;
  auto seg = Segment::create(name, l, kJob);
  {
    StudentEndpoint st(seg, 0, hostOnly(0));
    TeacherEndpoint t(seg, hostOnly(1));
    t.waitAdmission(Deadline::after(10s));
    st.waitAdmission(Deadline::after(10s));
    for (int64_t bytes : {int64_t(64), int64_t(4096)}) {
      auto x = at::empty({bytes}, at::kBool);
      std::memset(x.data_ptr(), 1, size_t(bytes));
      OutMessage m;
      m.tensors.push_back({"x", x});
      std::vector<double> us;
      const int n = 100000, batch = 100;
      for (int i = -20; i < n / batch; ++i) {
        const auto t0 = Clock::now();
        for (int k = 0; k < batch; ++k) {
          m.tag.seq = uint64_t(k);
          st.send(m, Deadline::after(10s));
          auto q = t.waitAny(Deadline::after(10s));
          OutMessage r;
          r.tag = q.tag();
          r.kind = MsgKind::kResponse;
          r.tensors.push_back({"y", q.view("x")});
          t.reply(q.student(), r, Deadline::after(10s));
          q.release();
          st.receive(Deadline::after(10s)).release();
        }
        if (i >= 0) us.push_back(seconds(Clock::now() - t0) * 1e6 / batch);
      }
      printRoundTrip("selfloop", bytes, std::move(us));
    }
  }
  Segment::remove(name);
}

// ---- gloo: the same payloads through c10d ProcessGroupGloo send/recv ---------------------------------

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> glooGroup(int rank, int port) {
  c10d::TCPStoreOptions so;
  so.port = uint16_t(port);
  so.isServer = rank == 0;
  so.numWorkers = 2;
  so.timeout = std::chrono::milliseconds(30000);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(30000));
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, opts);
}

void benchGloo() {
  const int port = freePort();
  auto iters = [](int64_t bytes) { return bytes <= 4096 ? 3000 : 1000; };
  pid_t child = forkRun([&] {
    auto pg = glooGroup(1, port);
    for (int64_t bytes : kRoundTripSizes) {
      std::vector<at::Tensor> buf{at::empty({bytes}, at::kBool)};
      for (int i = -100; i < iters(bytes); ++i) {
        pg->recv(buf, 0, 0)->wait();
        pg->send(buf, 0, 0)->wait();
      }
    }
    return 0;
  });
  auto pg = glooGroup(0, port);
  for (int64_t bytes : kRoundTripSizes) {
    std::vector<at::Tensor> out{at::ones({bytes}, at::kBool)}, in{at::empty({bytes}, at::kBool)};
    std::vector<double> us;
    for (int i = -100; i < iters(bytes); ++i) {
      const auto t0 = Clock::now();
      pg->send(out, 1, 0)->wait();
      pg->recv(in, 1, 0)->wait();
      if (i >= 0) us.push_back(seconds(Clock::now() - t0) * 1e6);
    }
    printRoundTrip("gloo", bytes, std::move(us));
  }
  reap(child);
}

} // namespace

// bench_ring [memcpy|oneway|roundtrip|gloo|selfloop]...: the named parts only (default: all).
int main(int argc, char** argv) {
  at::set_num_threads(1);
  const auto start = Clock::now();
  auto want = [&](const char* part) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; ++i)
      if (std::strcmp(argv[i], part) == 0) return true;
    return false;
  };
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "memcpy") && std::strcmp(argv[i], "oneway") && std::strcmp(argv[i], "roundtrip") &&
        std::strcmp(argv[i], "gloo") && std::strcmp(argv[i], "selfloop")) {
      std::fprintf(stderr, "bench_ring: unknown part '%s' (memcpy, oneway, roundtrip, gloo, selfloop)\n", argv[i]);
      return 2;
    }
  if (want("memcpy")) benchMemcpy();
  if (want("oneway")) benchOneWay();
  if (want("roundtrip")) benchRoundTrip();
  if (want("gloo")) benchGloo();
  if (want("selfloop")) benchSelfLoop();
  if (argc > 1) return 0; // ratios need every part
  auto r = [](const std::string& k) { return gResults.count(k) ? gResults[k] : 0.0; };
  const std::string mib = std::to_string(1 << 20), mib64 = std::to_string(64 << 20), k4 = std::to_string(4096);
  std::printf(
      "{\"bench\":\"ring\",\"ratios\":{\"copy_over_memcpy_1MiB\":%.3f,\"copy_over_memcpy_16MiB\":%.3f,"
      "\"copy_over_memcpy_64MiB\":%.3f,\"inslot_over_copy_1MiB\":%.2f,\"roundtrip_p50_us_64B\":%.2f,"
      "\"gloo_over_ring_roundtrip_p50_4KiB\":%.1f,\"software_share_roundtrip_4KiB\":%.2f,\"total_s\":%.1f}}\n",
      r("copy/" + mib) / r("memcpy/" + mib),
      r("copy/" + std::to_string(16 << 20)) / r("memcpy/" + std::to_string(16 << 20)),
      r("copy/" + mib64) / r("memcpy/" + mib64), r("inslot/" + mib) / r("copy/" + mib), r("copy/rt/64"),
      r("gloo/rt/" + k4) / r("copy/rt/" + k4), r("selfloop/rt/" + k4) / r("copy/rt/" + k4),
      seconds(Clock::now() - start));
  return 0;
}
