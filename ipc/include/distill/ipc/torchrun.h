#pragma once

// A job started by torchrun has no distill-run to make each node's segment.
// Every local process computes the same name from what torchrun gives them
// all — its agent's pid (their parent), TORCHELASTIC_RUN_ID, MASTER_ADDR (not
// the port, which a restart's rendezvous may change) and TORCHELASTIC_RESTART_COUNT — and the first to arrive creates it (an
// exclusive create: exactly one wins), recording the agent as its creator;
// the others attach. A restart (torchrun --max-restarts) is a new attempt
// with a new segment: the first process of an attempt removes the earlier
// attempts' segments of the same agent, and any segment whose creator is gone
// (a SIGKILLed agent's). The teacher removes its segment when it has served
// every student.

#include "distill/core/config.h"
#include "distill/core/topology.h"

namespace distill::ipc {

// Under torchrun with no DISTILL_SEGMENT: sets topo.segment and topo.jobId
// and makes sure the node's segment exists (created here or attached to,
// within run.startup_timeout_s). Otherwise does nothing.
void joinTorchrunSegment(Topology& topo, const Config& config);

// The segment name of attempt `restart` for the given run (tests).
std::string torchrunSegmentName(const std::string& runId, int agentPid, const std::string& master, int restart,
                                int node);

} // namespace distill::ipc
