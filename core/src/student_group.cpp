#include "distill/core/student_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <sstream>

#include "distill/build_config.h"
#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/options.h"
#include "distill/core/rendezvous.h"
#include "distill/core/strings.h"
#include "distill/core/topology.h"
#include "distill/core/trace.h"
#include "job_store.h"
#include "nccl_backend.h"

namespace distill {
namespace {

c10d::ReduceOp toC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kAvg:
      return c10d::ReduceOp::AVG;
  }
  return c10d::ReduceOp::SUM;
}

bool isLoopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

std::string firstLineOf(const std::string& s) { return s.substr(0, s.find('\n')); }

} // namespace

struct StudentGroup::Impl {
  int rank = 0;
  int size = 0;
  int perNode = 1; // students per node: student rank r is on node r / perNode
  Millis timeout{0};
  int64_t seq = 0;
  // Declared first, destroyed last: the store outlives every client of it.
  std::unique_ptr<JobStoreServer> server; // student rank 0: the rendezvous store
  c10::intrusive_ptr<JobStore> jobStore; // this rank's connection (null under torchrun's agent store)
  c10::intrusive_ptr<c10d::Store> store; // prefixed "distill/students/"
  c10::intrusive_ptr<c10d::Backend> gloo;
  c10::intrusive_ptr<c10d::Backend> nccl; // null unless CUDA tensors may be reduced

  bool serving = false; // this rank hosts the store (student rank 0)
  std::string storeWhere; // "127.0.0.1:29500 (served by student rank 0 on node 0)"
  std::string storeHostPort; // "127.0.0.1:29500"

  std::string studentName(int r) const {
    return "student rank " + std::to_string(r) + " (node " + std::to_string(r / perNode) + ")";
  }

  // What the store says after a failure: the ranks whose counter `<prefix><rank>`
  // is below `needed` (they never got there), the ranks lost so far (their
  // connection to the store closed without a goodbye: died or failed), first
  // lost first, or why the store itself is unreachable (its host was lost).
  struct Diagnosis {
    std::vector<int> absent;
    std::vector<int> lost;
    bool storeLost = false; // the store did not answer: its connection closed
  };
  // `lossGrace`: how long to wait for a first loss to be recorded (a peer's
  // death and the error it causes here race by milliseconds). The store lives
  // in student rank 0's process, so the other ranks must read it before rank 0
  // exits: each rank reports having read, and rank 0 waits (bounded) until
  // every present rank has, before it throws.
  Diagnosis diagnose(const std::string& prefix, int64_t needed, const std::string& tag, Millis lossGrace) {
    Diagnosis d;
    try {
      if (jobStore) d.lost = jobStore->lostRanks(lossGrace);
      for (int r = 0; r < size; ++r) {
        // add(key, 0) reads without blocking (get would wait for the key to exist).
        if (store->add(prefix + std::to_string(r), 0) < needed) d.absent.push_back(r);
      }
      int present = size - static_cast<int>(d.absent.size());
      if (store->add("diagnosed/" + tag, 1) >= present) {
        store->set("diagnosed/" + tag + "/all", std::vector<uint8_t>{1});
      }
      if (serving) {
        store->setTimeout(kDiagnoseGrace);
        store->wait({"diagnosed/" + tag + "/all"});
      }
    } catch (const PeerLostError&) {
      d.storeLost = true;
    } catch (const std::exception&) {
      // A peer never read (rank 0's bounded wait): report what we know.
    }
    return d;
  }
  static constexpr Millis kDiagnoseGrace{3000};
  static constexpr Millis kLossGrace{1000};

  // "student rank 2 (node 1) was lost first (...); then student rank 3 (node 1)"
  // + "; student rank(s) 2, 3 never entered it", or the store host lost.
  std::string explain(const Diagnosis& d, const std::string& neverWhat) const {
    std::vector<std::string> parts;
    if (d.storeLost) {
      parts.push_back("the rendezvous store's host, student rank 0 (node 0) at " + storeHostPort +
                      ", was lost (the connection to it closed: its process is gone?)");
    } else if (!d.lost.empty()) {
      std::string s = studentName(d.lost[0]) +
          " was lost first (its connection to the rendezvous store closed without a goodbye: "
          "its process died or failed)";
      if (d.lost.size() > 1) {
        s += "; then ";
        std::vector<std::string> later;
        for (size_t i = 1; i < d.lost.size(); ++i) later.push_back(studentName(d.lost[i]));
        s += join(later);
      }
      parts.push_back(s);
    }
    if (!d.absent.empty()) parts.push_back("student rank(s) " + join(d.absent) + " " + neverWhat);
    std::string out;
    for (auto& p : parts) out += (out.empty() ? "" : "; ") + p;
    return out;
  }

  // Runs one collective with the arrival bookkeeping and the deadline.
  void run(const std::string& what, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
    const int64_t mySeq = ++seq;
    const std::string awaited = "student group " + what + " #" + std::to_string(mySeq);
    trace::Event ev; // the flight recorder: the hang table shows who is in which collective
    ev.op = trace::Op::kCollective;
    ev.seq = static_cast<uint64_t>(mySeq);
    ev.label = what;
    currentStep(&ev.step, &ev.accStep);
    trace::Scope recorded(ev);
    auto deadline = Deadline::after(timeout);
    std::string how; // "" = done
    try {
      store->add("arrived/" + std::to_string(rank), 1);
      auto work = start();
      // gloo bounds its own transfers by the same timeout; wait() adds ours for NCCL.
      if (!work->wait(timeout)) how = "timed out after " + std::to_string(timeout.count()) + " ms";
    } catch (const std::exception& e) {
      const auto* mine = dynamic_cast<const Error*>(&e);
      // Ours other than a lost peer or store, or a timeout: not a peer's doing.
      if (mine && !dynamic_cast<const PeerLostError*>(mine) && !dynamic_cast<const TimeoutError*>(mine)) throw;
      how = (deadline.expired() ? "timed out after " + std::to_string(timeout.count()) + " ms: "
                                : std::string("failed: ")) +
          firstLine(mine ? mine->message() : std::string(e.what()));
    }
    if (!how.empty()) failed(what, mySeq, awaited, how);
  }

  [[noreturn]] void failed(const std::string& what, int64_t mySeq, const std::string& awaited, const std::string& how) {
    const bool timedOut = how.rfind("timed out", 0) == 0;
    auto d = diagnose("arrived/", mySeq, "c" + std::to_string(mySeq), timedOut ? Millis(0) : kLossGrace);
    std::string who = explain(d, "never entered it");
    if (who.empty()) who = "every student rank entered it; a peer failed inside it";
    if (timedOut) {
      DISTILL_THROW(TimeoutError, awaiting(awaited), "student group ", what, " #", mySeq, " ", how, "; ", who);
    }
    DISTILL_THROW(PeerLostError, awaiting(awaited), "student group ", what, " #", mySeq, " ", how, "; ", who);
  }

  static std::string firstLine(const std::string& s) {
    auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }

  c10d::Backend& backendFor(const std::vector<at::Tensor>& tensors) {
    if (!tensors.empty() && tensors[0].is_cuda()) {
      DISTILL_CHECK_T(ConfigError, nccl,
                      "CUDA tensors given to the student group, but it has no "
                      "NCCL backend (built with DISTILL_CUDA=",
                      DISTILL_CUDA,
                      ", student.device/student.backend select gloo); move them to CPU or set "
                      "student.device: cuda");
      return *nccl;
    }
    return *gloo;
  }

  void openAgentStore(const Topology& topo, Millis startup, const std::string& hostPort);
  void openJobStore(const Topology& topo, Deadline deadline, const std::string& hostPort);
  void admit(Deadline deadline, Millis startup);
  void createBackends(const Topology& topo, const StudentOptions& student);
};

namespace {

// Under torchrun the agent already serves a store at MASTER_ADDR:MASTER_PORT.
bool useAgentStore() {
  const char* agentStore = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return agentStore && std::string(agentStore) == "True";
}

} // namespace

// The store of torchrun's agent, under a prefix of its own.
void StudentGroup::Impl::openAgentStore(const Topology& topo, Millis startup, const std::string& hostPort) {
  auto& s = *this;
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(topo.masterPort);
  opts.isServer = false;
  opts.numWorkers = static_cast<size_t>(s.size);
  opts.waitWorkers = false; // admission below has its own deadline and names who is missing
  opts.timeout = startup;
  s.storeWhere = hostPort + " (torchrun's agent store)";
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(topo.masterAddr, opts);
    s.store = c10::make_intrusive<c10d::PrefixStore>("distill/students", tcp);
  } catch (const std::exception& e) {
    DISTILL_THROW(TimeoutError, awaiting("student group store at " + hostPort),
                  "student group: cannot reach torchrun's store at ", hostPort, " within ", startup.count(),
                  " ms: ", Impl::firstLine(e.what()));
  }
}

// distill's own authenticated store (job_store.h), served by student rank 0.
void StudentGroup::Impl::openJobStore(const Topology& topo, Deadline deadline, const std::string& hostPort) {
  auto& s = *this;
  const char* secretEnv = std::getenv(kJobSecretEnv);
  const std::string secret = secretEnv ? secretEnv : "";
  if (secret.empty()) {
    DISTILL_LOG(kWarning) << kJobSecretEnv << " is not set: the student group's rendezvous store at " << hostPort
                          << " takes any process that connects (distill-run sets a secret per job)";
  }
  if (s.rank == 0) {
    // distill-run binds the socket (to check the port before anything
    // starts, and to choose a free one) and hands it over; a rank started
    // otherwise binds it here. Either way to run.master_addr only.
    int fd = -1;
    if (const char* inherited = std::getenv(kStoreFdEnv); inherited && *inherited) {
      fd = std::atoi(inherited);
      const int port = listeningPort(fd);
      DISTILL_CHECK_T(
          ConfigError, port == topo.masterPort, kStoreFdEnv, "=", inherited,
          " is not a socket listening on MASTER_PORT ", topo.masterPort,
          port < 0 ? std::string(" (not a listening socket)") : " (it listens on " + std::to_string(port) + ")");
    } else {
      fd = listenForStore(topo.masterAddr, topo.masterPort).fd;
    }
    s.server = std::make_unique<JobStoreServer>(fd, secret, hostPort);
    s.serving = true;
  }
  s.jobStore = c10::make_intrusive<JobStore>(topo.masterAddr, topo.masterPort, secret, s.rank,
                                             "student rank 0 on node 0", deadline);
  s.store = c10::make_intrusive<c10d::PrefixStore>("distill/students", s.jobStore);
}

// Admission: every student announces itself, then waits (deadline) for all.
void StudentGroup::Impl::admit(Deadline deadline, Millis startup) {
  auto& s = *this;
  try {
    s.store->setTimeout(std::max(Millis(1), std::chrono::ceil<Millis>(deadline.remaining())));
    s.store->add("joined/" + std::to_string(s.rank), 1);
    if (s.store->add("joined", 1) == s.size) s.store->set("all_joined", std::vector<uint8_t>{1});
  } catch (const std::exception& e) {
    DISTILL_THROW(PeerLostError, awaiting("student group rendezvous"), "student group: lost the rendezvous store at ",
                  s.storeWhere, ": ", Impl::firstLine(e.what()));
  }
  for (;;) {
    if (deadline.expired()) {
      auto d = s.diagnose("joined/", 1, "rendezvous", Millis(0));
      DISTILL_THROW(TimeoutError, awaiting("student group rendezvous"), "student group: ", d.absent.size(), " of ",
                    s.size, " student rank(s) never joined within ", startup.count(), " ms: missing student rank(s) ",
                    join(d.absent),
                    d.lost.empty() && !d.storeLost ? "" : "; " + s.explain({{}, d.lost, d.storeLost}, ""));
    }
    // The store has no blocking "wait until counter >= n": wait() on the key
    // that the last student to join sets, bounded by the time left.
    try {
      s.store->setTimeout(std::max(Millis(1), std::chrono::ceil<Millis>(deadline.remaining())));
      s.store->wait({"all_joined"});
      break;
    } catch (const std::exception& e) {
      // A timeout: the loop reports who is missing. Anything earlier is the store failing.
      if (deadline.remaining() > Millis(50)) {
        DISTILL_THROW(PeerLostError, awaiting("student group rendezvous"),
                      "student group: lost the rendezvous store at ", s.storeWhere, ": ", Impl::firstLine(e.what()));
      }
    }
  }
}

// gloo always (CPU tensors, the small collectives), NCCL for CUDA students.
void StudentGroup::Impl::createBackends(const Topology& topo, const StudentOptions& student) {
  auto& s = *this;
  // gloo rendezvous itself (connectFullMesh) is bounded by the store's timeout.
  auto glooOpts = c10d::ProcessGroupGloo::Options::create(s.timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && *ifname) {
    glooOpts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (isLoopback(topo.masterAddr)) {
    glooOpts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    glooOpts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto glooStore = c10::make_intrusive<c10d::PrefixStore>("gloo", s.store);
  s.gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(glooStore, s.rank, s.size, glooOpts);

  bool wantNccl = student.backend == GroupBackend::kNccl ||
      (student.backend == GroupBackend::kAuto && parseDevice(student.device).cuda);
  if (wantNccl) {
    s.nccl = makeNcclBackend(c10::make_intrusive<c10d::PrefixStore>("nccl", s.store), s.rank, s.size, s.timeout,
                             student.device);
  }
  DISTILL_LOG(kInfo) << "student group ready: rank " << s.rank << "/" << s.size << " (gloo" << (s.nccl ? " + nccl" : "")
                     << "), collective timeout " << s.timeout.count() << " ms";
}

StudentGroup::StudentGroup(const Topology& topo, const RunOptions& run, const StudentOptions& student)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.rank = topo.studentRank;
  s.size = topo.studentWorldSize;
  s.perNode = std::max(1, topo.studentsPerNode());
  s.timeout = secondsToMillis(run.collective_timeout_s);
  const Millis startup = secondsToMillis(run.startup_timeout_s);
  DISTILL_CHECK_T(ConfigError, topo.masterPort > 0, "student group: MASTER_PORT is not set");
  auto deadline = Deadline::after(startup);
  const std::string hostPort = topo.masterAddr + ":" + std::to_string(topo.masterPort);
  s.storeWhere = hostPort + " (served by student rank 0 on node 0)";
  s.storeHostPort = hostPort;
  if (useAgentStore()) {
    s.openAgentStore(topo, startup, hostPort);
  } else {
    s.openJobStore(topo, deadline, hostPort);
  }
  s.admit(deadline, startup);
  s.store->setTimeout(s.timeout);
  s.createBackends(topo, student);
}

StudentGroup::~StudentGroup() = default;

int StudentGroup::rank() const { return impl_->rank; }
int StudentGroup::size() const { return impl_->size; }
std::chrono::milliseconds StudentGroup::timeout() const { return impl_->timeout; }
int64_t StudentGroup::sequence() const { return impl_->seq; }

void StudentGroup::barrier(const std::string& what) {
  impl_->run(what, [&] {
    c10d::BarrierOptions o;
    o.timeout = impl_->timeout;
    return impl_->gloo->barrier(o);
  });
}

void StudentGroup::allReduce(std::vector<at::Tensor>& tensors, ReduceOp op, const std::string& what) {
  auto& backend = impl_->backendFor(tensors);
  impl_->run(what, [&] {
    c10d::AllreduceOptions o;
    o.reduceOp = toC10d(op);
    o.timeout = impl_->timeout;
    return backend.allreduce(tensors, o);
  });
}

void StudentGroup::allReduce(at::Tensor& tensor, ReduceOp op, const std::string& what) {
  std::vector<at::Tensor> v{tensor};
  allReduce(v, op, what);
}

void StudentGroup::broadcast(std::vector<at::Tensor>& tensors, int root, const std::string& what) {
  DISTILL_CHECK_T(ConfigError, root >= 0 && root < impl_->size, "broadcast root ", root, " is not a student rank (0..",
                  impl_->size - 1, ")");
  auto& backend = impl_->backendFor(tensors);
  impl_->run(what, [&] {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = impl_->timeout;
    return backend.broadcast(tensors, o);
  });
}

void StudentGroup::broadcast(at::Tensor& tensor, int root, const std::string& what) {
  std::vector<at::Tensor> v{tensor};
  broadcast(v, root, what);
}

// ---- notes ----

struct GroupNotes::Impl {
  c10::intrusive_ptr<c10d::Store> store; // a clone: its own connection

  // `doing` is "posting", "awaiting", ...; `what` names the note(s).
  [[noreturn]] static void lost(const std::string& doing, const std::string& what, const std::exception& e) {
    DISTILL_THROW(PeerLostError, doing == "awaiting" ? awaiting("student group note " + what) : ErrorWhere{},
                  "student group notes: lost the rendezvous store (served by student rank 0) while ", doing, " ", what,
                  ": ", firstLineOf(e.what()));
  }
};

GroupNotes::GroupNotes() : impl_(std::make_unique<Impl>()) {}
GroupNotes::~GroupNotes() = default;

void GroupNotes::post(const std::string& key, const std::string& value) {
  try {
    impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    Impl::lost("posting", key, e);
  }
}

std::vector<std::optional<std::string>> GroupNotes::await(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::optional<std::string>> out(keys.size());
  if (keys.empty()) return out;
  bool all = false;
  try {
    // The server answers when the last key is set: no polling.
    impl_->store->wait(keys, std::max(timeout, Millis(1)));
    all = true;
  } catch (const std::exception&) {
    // A timeout, or the store gone: check() below tells which.
  }
  try {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!all && !impl_->store->check({keys[i]})) continue;
      auto v = impl_->store->get(keys[i]);
      out[i] = std::string(v.begin(), v.end());
    }
  } catch (const std::exception& e) {
    Impl::lost("awaiting", keys.front() + (keys.size() > 1 ? " and " + std::to_string(keys.size() - 1) + " more" : ""),
               e);
  }
  return out;
}

void GroupNotes::erase(const std::string& key) {
  try {
    impl_->store->deleteKey(key);
  } catch (const std::exception& e) {
    Impl::lost("removing", key, e);
  }
}

std::unique_ptr<GroupNotes> StudentGroup::notes(const std::string& prefix) {
  std::unique_ptr<GroupNotes> n(new GroupNotes());
  try {
    n->impl_->store = c10::make_intrusive<c10d::PrefixStore>("notes/" + prefix, impl_->store->clone());
  } catch (const std::exception& e) {
    GroupNotes::Impl::lost("connecting for", "notes " + prefix, e);
  }
  n->impl_->store->setTimeout(impl_->timeout);
  return n;
}

} // namespace distill
