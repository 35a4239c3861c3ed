// The student group's rendezvous store (student_group_impl.h): torchrun's
// agent's, or distill's own served by student rank 0; and a fresh connection
// to it under a prefix (StudentGroup::store).
#include <cstdlib>
#include <string>

#include "distill/core/logging.h"
#include "distill/core/topology.h"
#include "distill/group/rendezvous.h"
#include "student_group_impl.h"

namespace distill {

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
    // A torchrun restart (--max-restarts) is a new attempt on the same store: its own keys.
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    s.store = c10::make_intrusive<c10d::PrefixStore>(
        std::string("distill/students/attempt") + (attempt && *attempt ? attempt : "0"), tcp);
  } catch (const std::exception& e) {
    DISTILL_THROW(TimeoutError, awaiting("student group store at " + hostPort),
                  "student group: cannot reach torchrun's store at ", hostPort, " within ", startup.count(),
                  " ms: ", firstLineOf(e.what()));
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

c10::intrusive_ptr<c10d::Store> StudentGroup::store(const std::string& prefix) {
  c10::intrusive_ptr<c10d::Store> base;
  try {
    base = impl_->jobStore ? c10::intrusive_ptr<c10d::Store>(impl_->jobStore->cloneAs(-1)) : impl_->store->clone();
  } catch (const std::exception& e) {
    DISTILL_THROW(PeerLostError, "student group: cannot open a connection to the rendezvous store at ",
                  impl_->storeWhere, " for ", prefix, ": ", firstLineOf(e.what()));
  }
  auto s = impl_->jobStore ? c10::make_intrusive<c10d::PrefixStore>("distill/students/" + prefix, base)
                           : c10::make_intrusive<c10d::PrefixStore>(prefix, base);
  s->setTimeout(impl_->timeout);
  return s;
}

} // namespace distill
