// The roles launcher_test's jobs run (support/roles.h): `job`, the trainer
// under distill-run in its modes (and, with teacher.kind self, its teacher), and
// `small_shm`, distill-run in a mount namespace whose /dev/shm is 8 MiB. Part
// of launcher_test; the tests are in launcher_test.cpp and its siblings.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <sys/stat.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>

#include "balance.h"
#include "console.h"
#include "distill/distill.h"
#include "distill/ipc/segment.h"
#include "job_store.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/process.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

distill::Session initSession() {
  int argc = 1;
  char arg0[] = "launcher_test";
  char* argv[] = {arg0, nullptr};
  return distill::init(argc, argv);
}

int envInt(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : -1;
}

// Blocks (up to 30 s, never forever) until a signal ends this process.
int blockUntilKilled() {
  ::poll(nullptr, 0, 30000);
  std::printf("still alive after 30 s\n");
  return 4;
}

// A teacher that doubles its input, served until every student finished.
int serveDoubler(distill::Session& s) {
  auto stats = distill::serve(*s.teacher, doublerTeacher());
  std::printf("teacher served %lld requests\n", static_cast<long long>(stats.requests));
  return 0;
}

// The elastic-teacher test's teacher: doubles its input, and SIGKILLs itself
// inside its `killAt`-th forward (a batch in flight) when it is the first
// incarnation (or every incarnation when `always`).
int serveDoublerThatDies(distill::Session& s, int killAt, bool always) {
  const bool restarted = std::getenv("DISTILL_TEACHER_RESTART") != nullptr;
  std::printf("teacher incarnation %s\n", restarted ? std::getenv("DISTILL_TEACHER_RESTART") : "0");
  int calls = 0;
  auto doubler = distill::teacherFromFunction([&](const std::vector<at::Tensor>& in) {
    if (++calls == killAt && (always || !restarted)) {
      std::printf("teacher: SIGKILL inside forward %d\n", calls);
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    return in.at(0).to(torch::kFloat) * 2;
  });
  auto stats = distill::serve(*s.teacher, doubler);
  std::printf("teacher served %lld requests\n", static_cast<long long>(stats.requests));
  return 0;
}

} // namespace

// The trainer under distill-run. args[0] = mode:
//   ok     3 steps through the teacher, raw lines and a published status each, finish
//   fail   student 0 prints 30 lines and exits 3; the others wait to be killed
//          (student 1 ignores SIGTERM when args[1] == "stubborn")
//   kill   student 0 prints a line and SIGKILLs itself; the others wait
//   stop   steps until Client::stopRequested(), then "checkpoint" and finish
//   ignore students publish step 7 (and a teacher wait share 0.2 when args[1] ==
//          "wait-share"), print READY and wait to be killed (they ignore the stop flag)
//   grad   one step of a tiny model on rank-dependent data, gradients all-reduced
//   exit0-early     student 1 exits 0 before distill::init; student 0 waits to be killed
//   hold            students join, print READY with their pid, wait for args[1] (a FIFO), then finish
//   collect         students ask and all-reduce for up to 30 s, READY with their pid after the first round
//   detach-first    student 0 throws after a step (its session detaches abnormally) and lingers
//                   until SIGTERM; student 1 asks until the teacher is gone
//   elastic         10 steps x 2 micro-batches, every answer checked; the teacher
//                   SIGKILLs itself in its 5th forward once (elastic-always: each time)
DISTILL_TEST_ROLE(job) {
  const std::string mode = args.at(0);
  const bool stubborn = args.size() > 1 && args[1] == "stubborn";
  const char* role = std::getenv("DISTILL_ROLE");
  const bool teacher = role && std::string(role) == "teacher";
  if (!teacher && stubborn && envInt("DISTILL_LOCAL_RANK") == 1) ::signal(SIGTERM, SIG_IGN);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (mode == "exit0-early" && !teacher && envInt("DISTILL_LOCAL_RANK") == 1) {
    std::printf("student 1: nothing to train, exiting 0 before distill::init\n");
    return 0;
  }
  if (mode == "detach-first" && !teacher && envInt("DISTILL_LOCAL_RANK") == 0) {
    try {
      distill::Session s = initSession();
      auto x = torch::arange(4, torch::kLong);
      s.client->get(s.client->submit(x, 0, 0));
      throw std::runtime_error("student 0: a bad batch at step 1");
    } catch (const std::exception& e) {
      // The session is gone (detached abnormally); the process lingers, as
      // one busy in slow destructors or a hung flush would, until torn down.
      std::printf("FAILED %s\n", e.what());
      std::fflush(stdout);
      return waitForSigterm(std::chrono::seconds(30)) ? 1 : 4;
    }
  }
  distill::Session s = initSession();
  if (s.isTeacher() && (mode == "elastic" || mode == "elastic-always"))
    return serveDoublerThatDies(s, 5, mode == "elastic-always");
  if (s.isTeacher()) return serveDoubler(s);
  const int rank = s.topology.studentRank;
  auto& group = s.student->group();
  auto ask = [&](int64_t step) {
    auto x = torch::arange(4, torch::kLong) + step;
    auto y = s.client->get(s.client->submit(x, step, 0)).tensor(distill::protocol::kLogits);
    DISTILL_CHECK(torch::equal(y, x.to(torch::kFloat) * 2), "wrong answer from the teacher");
  };
  if (mode == "ok") {
    for (int64_t step = 0; step < 3; ++step) {
      ask(step);
      std::printf("plain line from student %d step %lld\n", rank, static_cast<long long>(step));
      distill::StudentStatus st;
      st.step = step, st.loss = 1.0 + rank, st.tokens_per_s = 1000;
      s.client->publishStatus(st);
    }
    s.client->finish();
    return 0;
  }
  if (mode == "exit0-early") return blockUntilKilled(); // student 0: never admitted without student 1
  if (mode == "hold") {
    // Joined and admitted; waits (30 s at most) until args[1] (a FIFO) is written, then one more round.
    group.barrier("before hold");
    std::printf("READY student %d pid %d\n", rank, static_cast<int>(::getpid()));
    int fd = ::open(args.at(1).c_str(), O_RDONLY | O_NONBLOCK);
    pollfd p{fd, POLLIN, 0};
    if (fd < 0 || ::poll(&p, 1, 30000) != 1) return 6;
    ::close(fd);
    ask(1);
    group.barrier("after hold");
    std::printf("HELD student %d\n", rank);
    s.client->finish();
    return 0;
  }
  if (mode == "collect") {
    // Asks and all-reduces for up to 30 s, announcing itself after the first round.
    const auto deadline = SteadyClock::now() + std::chrono::seconds(30);
    for (int64_t step = 0; SteadyClock::now() < deadline; ++step) {
      ask(step);
      auto t = torch::ones({16});
      group.allReduce(t, distill::ReduceOp::kSum, "sum");
      if (step == 0) std::printf("READY student %d pid %d\n", rank, static_cast<int>(::getpid()));
    }
    return 5;
  }
  if (mode == "detach-first") {
    // Student 1 asks until the teacher is gone (it goes when student 0 does).
    const auto deadline = SteadyClock::now() + std::chrono::seconds(30);
    for (int64_t step = 0; SteadyClock::now() < deadline; ++step) ask(step);
    return 5;
  }
  if (mode == "fail" || mode == "kill") {
    if (rank != 0) return blockUntilKilled();
    for (int i = 0; i < 30; ++i) std::printf("fail-line %d\n", i);
    if (mode == "kill") ::raise(SIGKILL);
    return 3;
  }
  if (mode == "stop") {
    const auto deadline = SteadyClock::now() + std::chrono::seconds(30);
    for (int64_t step = 0; SteadyClock::now() < deadline; ++step) {
      ask(step);
      if (step == 0) std::printf("READY student %d\n", rank);
      if (s.client->stopRequested()) {
        std::printf("checkpoint at step %lld, leaving\n", static_cast<long long>(step));
        s.client->finish();
        return 0;
      }
    }
    return 5;
  }
  if (mode == "ignore") {
    distill::StudentStatus st;
    st.step = 7, st.loss = 0.25, st.tokens_per_s = 50,
    st.teacher_wait_share = args.size() > 1 && args[1] == "wait-share" ? 0.2 : st.kUnset;
    s.client->publishStatus(st);
    std::printf("READY student %d\n", rank);
    return blockUntilKilled();
  }
  if (mode == "elastic" || mode == "elastic-always") {
    // 10 steps x 2 micro-batches, two requests in flight; every answer is
    // checked against its own request (a lost answer hangs into the deadline,
    // a duplicate or a reordered one breaks the Client's tag check).
    constexpr int kSteps = 10, kAcc = 2;
    int answers = 0;
    for (int64_t step = 0; step < kSteps; ++step) {
      answers += distill::testing::doublerStep(*s.client, rank, step, kAcc);
      group.barrier();
      distill::StudentStatus st;
      st.step = step;
      s.client->publishStatus(st);
    }
    std::printf("ANSWERS rank=%d n=%d of %d\n", rank, answers, kSteps * kAcc);
    // Every get() waited for an answer the teacher had still to compute or send.
    std::printf("WAITED rank=%d positive=%d\n", rank, s.client->teacherWaitSeconds() > 0 ? 1 : 0);
    s.client->finish();
    return 0;
  }
  if (mode == "grad") {
    torch::manual_seed(0);
    torch::nn::Linear model(4, 3); // the same initial weights on every student
    torch::manual_seed(100 + rank);
    auto x = torch::randn({8, 4}); // different data per student
    auto target =
        s.client->get(s.client->submit(torch::arange(3, torch::kLong), 0, 0)).tensor(distill::protocol::kLogits);
    auto loss = (model->forward(x) - target).pow(2).mean();
    loss.backward();
    std::vector<at::Tensor> params = model->parameters();
    double local = 0;
    for (auto& p : params) local += p.grad().abs().sum().item<double>();
    distill::allReduceGradients(group, params, 1.0);
    double reduced = 0;
    for (auto& p : params) reduced += (p.grad() / group.size()).abs().sum().item<double>();
    std::printf("GRADSUM rank=%d size=%d local=%.9e reduced=%.9e\n", rank, group.size(), local, reduced);
    s.client->finish();
    return 0;
  }
  std::printf("unknown mode %s\n", mode.c_str());
  return 98;
}

// Runs args[0] (distill-run) with args[1..] in a mount namespace of its own
// whose /dev/shm is an 8 MiB tmpfs. Prints "SKIP: ..." and exits 77 where
// mount namespaces are not allowed.
DISTILL_TEST_ROLE(small_shm) {
  if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
      ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=8m,mode=1777") != 0) {
    std::printf("SKIP: no mount namespace here: %s\n", std::strerror(errno));
    return 77;
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  std::printf("cannot exec %s: %s\n", argv[0], std::strerror(errno));
  return 127;
}
