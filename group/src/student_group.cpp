#include "distill/group/student_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <sstream>

#include "distill/core/logging.h"
#include "distill/core/options.h"
#include "distill/group/rendezvous.h"
#include "distill/core/sys.h"
#include "distill/core/topology.h"
#include "nccl_backend.h"
#include "student_group_impl.h"

// The group's making: the choice of rendezvous store, admission of every
// student, the backends. The stores' set-up is in student_group_store.cpp,
// the notes board in group_notes.cpp, the collectives in student_group_ops.cpp.
namespace distill {
namespace {

bool isLoopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

// This host's address on the route to `host` (a UDP connect sends nothing; it
// only picks the route), "" when there is none. gloo binds each rank's
// listening socket to it: the interface the job's rendezvous reaches, never
// whatever the machine's hostname resolves to (a name that may not even be
// an address of this network namespace).
std::string localAddressTowards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port > 0 ? port : 9).c_str(), &hints, &res) != 0 || !res) return "";
  std::string out;
  for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
    Fd fd(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* src = local.ss_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in&>(local).sin_addr)
                                                 : static_cast<const void*>(&reinterpret_cast<sockaddr_in6&>(local).sin6_addr);
    if (::inet_ntop(local.ss_family, src, text, sizeof text)) out = text;
  }
  ::freeaddrinfo(res);
  return out;
}

} // namespace

namespace {

// Under torchrun the agent already serves a store at MASTER_ADDR:MASTER_PORT.
bool useAgentStore() {
  const char* agentStore = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return agentStore && std::string(agentStore) == "True";
}

} // namespace

// Admission: every student announces itself, then waits (deadline) for all.
void StudentGroup::Impl::admit(Deadline deadline, Millis startup) {
  auto& s = *this;
  try {
    s.store->setTimeout(std::max(Millis(1), std::chrono::ceil<Millis>(deadline.remaining())));
    s.store->add("joined/" + std::to_string(s.rank), 1);
    if (s.store->add("joined", 1) == s.size) s.store->set("all_joined", std::vector<uint8_t>{1});
  } catch (const std::exception& e) {
    DISTILL_THROW(PeerLostError, awaiting("student group rendezvous"), "student group: lost the rendezvous store at ",
                  s.storeWhere, ": ", firstLineOf(e.what()));
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
                      "student group: lost the rendezvous store at ", s.storeWhere, ": ", firstLineOf(e.what()));
      }
    }
  }
}

// A backend's own rendezvous over the store failed: gloo's connectFullMesh
// rethrows the store's error (lost, timed out) inside a c10::Error, which would
// otherwise end the process through std::terminate. A distill error instead,
// as every other failure of init.
[[noreturn]] void StudentGroup::Impl::connectFailed(const std::string& backend, const std::exception& e) const {
  const std::string text = firstLineOf(e.what());
  const std::string awaited = "student group " + backend + " rendezvous";
  if (saysTimedOut(text)) {
    DISTILL_THROW(TimeoutError, awaiting(awaited), "student group: ", backend, " could not connect the ", size,
                  " student ranks within ", timeout.count(), " ms: ", text);
  }
  DISTILL_THROW(PeerLostError, awaiting(awaited), "student group: ", backend, " could not connect the ", size,
                " student ranks: ", text);
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
  } else if (const std::string local = localAddressTowards(topo.masterAddr, topo.masterPort); !local.empty()) {
    glooOpts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local));
  } else {
    glooOpts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto glooStore = c10::make_intrusive<c10d::PrefixStore>("gloo", s.store);
  try {
    s.gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(glooStore, s.rank, s.size, glooOpts);
  } catch (const std::exception& e) {
    connectFailed("gloo", e);
  }

  // NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), so
  // auto takes it only when every student of the node can have a GPU of its own; otherwise the
  // students' CUDA tensors are reduced through gloo (ProcessGroupGloo copies them through the host).
  const bool cuda = parseDevice(student.device).cuda;
  const int gpus = cuda ? visibleCudaDevices() : 0;
  bool wantNccl = student.backend == GroupBackend::kNccl;
  if (student.backend == GroupBackend::kAuto && cuda) {
    wantNccl = gpus >= topo.studentsPerNode();
    s.cudaThroughGloo = !wantNccl;
    if (!wantNccl && s.rank == 0) {
      DISTILL_LOG(kInfo) << "student.backend auto: gloo for the CUDA tensors too: " << topo.studentsPerNode()
                         << " students per node share " << gpus << " visible GPU(s), and NCCL needs one GPU per rank";
    }
  }
  DISTILL_CHECK_T(ConfigError, !(student.backend == GroupBackend::kNccl && cuda && gpus > 0 && gpus < topo.studentsPerNode()),
                  "student.backend nccl: ", topo.studentsPerNode(), " students per node but ", gpus,
                  " visible GPU(s); NCCL needs a GPU per student rank (set student.backend: gloo or auto)");
  if (wantNccl) {
    try {
      s.nccl = makeNcclBackend(c10::make_intrusive<c10d::PrefixStore>("nccl", s.store), s.rank, s.size, s.timeout,
                               student.device);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      connectFailed("NCCL", e);
    }
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
  s.procsPerNode = std::max(s.perNode, topo.localWorldSize);
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

} // namespace distill
