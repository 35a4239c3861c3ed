#include "distill/ipc/torchrun.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "distill/core/clock.h"
#include "distill/core/logging.h"
#include "distill/ipc/segment.h"

namespace distill::ipc {
namespace {

std::string envOr(const char* key, const std::string& fallback) {
  const char* v = std::getenv(key);
  return v && *v ? v : fallback;
}

// 64-bit FNV-1a: a name, not a secret (the segment is 0600 and checked by job id).
uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string runHash(const std::string& runId, int agentPid, const std::string& master) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%012llx",
                static_cast<unsigned long long>(fnv1a(runId + "/" + std::to_string(agentPid) + "/" + master) &
                                                0xffffffffffffull));
  return buf;
}

} // namespace

std::string torchrunSegmentName(const std::string& runId, int agentPid, const std::string& master, int restart,
                                int node) {
  return "distill-" + runHash(runId, agentPid, master) + "-r" + std::to_string(restart) + "-n" + std::to_string(node);
}

void joinTorchrunSegment(Topology& topo, const Config& config) {
  if (!topo.torchrun || !topo.segment.empty()) return;
  const std::string runId = envOr("TORCHELASTIC_RUN_ID", "none");
  // The address, not the port: a rendezvous round of a restart may pick a new
  // MASTER_PORT, and the next attempt must find the earlier ones' names.
  const std::string master = topo.masterAddr;
  const int agent = static_cast<int>(::getppid());
  const int restart = std::atoi(envOr("TORCHELASTIC_RESTART_COUNT", "0").c_str());
  topo.segment = torchrunSegmentName(runId, agent, master, restart, topo.nodeRank);
  topo.jobId = runHash(runId, agent, master) + "-r" + std::to_string(restart);
  // Earlier attempts of this agent, and segments whose creator is gone.
  for (int k = 0; k < restart; ++k) {
    const std::string old = torchrunSegmentName(runId, agent, master, k, topo.nodeRank);
    if (Segment::remove(old)) {
      DISTILL_LOG(kInfo) << "removed /dev/shm/" << old << " of torchrun attempt " << k;
    }
  }
  for (auto& stale : Segment::removeStale("distill-"))
    DISTILL_LOG(kWarning) << "removed stale segment /dev/shm/" << stale << ": its creator is gone";
  const auto layout = SegmentLayout::fromConfig(config, topo.studentsPerNode(), topo.teachersPerNode);
  Segment::createOrAttach(topo.segment, layout, topo.jobId, agent,
                          Deadline::afterSeconds(config.run.startup_timeout_s));
}

} // namespace distill::ipc
