// distill-run's set-up of one node: the ranks' layout (who is a student, who
// a teacher, and which teacher serves which student), the --dry-run plan and
// the node's segment. Part of Supervisor (supervisor.h).
#include <unistd.h>
#include <climits>
#include <cstdio>
#include <cstdlib>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/group/rendezvous.h"
#include "supervisor.h"

namespace distill::launcher {
namespace {

std::string absolute(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

std::string exeDir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  std::string s(buf);
  return s.substr(0, s.rfind('/'));
}

} // namespace

// Local ranks 0..N-K-1 run the trainer as students; the last K (teacher.procs)
// run the teachers (bin/distill-teacher, or the trainer itself when
// teacher.kind is self). Student i of a node is served by teacher i % K.
void Supervisor::layOut(const std::string& segment, const std::string& jobId) {
  const RunOptions& run = cfg_.run;
  // One override per line: the config refused control characters in them.
  std::string sets;
  for (auto& o : a_.overrides) sets += o.setting + "\n";
  for (int local = 0; local < run.nproc_per_node; ++local) {
    Rank r;
    Topology& t = r.topo;
    t = Topology::forLocalRank(node_, run.nnodes, local, run.nproc_per_node, cfg_.teacher.procs);
    t.masterAddr = run.master_addr;
    t.masterPort = run.master_port;
    t.segment = segment;
    t.jobId = jobId;
    t.configPath = absolute(a_.config);
    r.env = topologyEnv(t);
    r.env["DISTILL_CONFIG"] = t.configPath;
    if (!sets.empty()) r.env["DISTILL_SET"] = sets;
    const bool selfTeacher = t.isTeacher() && cfg_.teacher.kind == TeacherKind::kSelf;
    r.argv = t.isStudent() || selfTeacher ? a_.trainer : std::vector<std::string>{exeDir() + "/distill-teacher"};
    const std::string which = t.isTeacher() && t.teachersPerNode > 1 ? " " + std::to_string(t.teacherIndex) : "";
    r.prefix = "[r" + std::to_string(t.globalRank) + " " + roleName(t.role) + which + "] ";
    r.ownPrefix = "[n" + std::to_string(node_) + " r" + std::to_string(t.globalRank) + " ";
    ranks_.push_back(std::move(r));
  }
}

int Supervisor::printPlan(const std::string& segment) const {
  const RunOptions& run = cfg_.run;
  std::printf("distill-run plan: node %d/%d, %d processes, segment /dev/shm/%s, logs %s\n", node_, run.nnodes,
              run.nproc_per_node, segment.c_str(), run.log_dir.c_str());
  for (auto& r : ranks_) {
    std::printf("%s%s:", r.prefix.c_str(), r.topo.describe().c_str());
    for (auto& x : r.argv) std::printf(" %s", x.c_str());
    std::printf("\n");
    for (auto& [k, v] : r.env) std::printf("    %s=%s\n", k.c_str(), k == kJobSecretEnv ? "(hidden)" : v.c_str());
  }
  std::printf("%s", assignmentText().c_str());
  return 0;
}

// Which teacher serves which students, one line per teacher:
//   "teacher 1 of 2: rank 4 (local 4), device cpu, serves students local 1, 3 (ranks 1, 3)"
std::string Supervisor::assignmentText() const {
  std::string out;
  for (auto& t : ranks_) {
    if (!t.topo.isTeacher()) continue;
    std::string locals, globals;
    for (auto& s : ranks_) {
      if (!s.topo.isStudent() || s.topo.teacherLocalRankOf(s.topo.studentLocalRank) != t.topo.localRank) continue;
      locals += (locals.empty() ? "" : ", ") + std::to_string(s.topo.localRank);
      globals += (globals.empty() ? "" : ", ") + std::to_string(s.topo.globalRank);
    }
    out += "teacher " + std::to_string(t.topo.teacherIndex) + " of " + std::to_string(t.topo.teachersPerNode) +
        ": rank " + std::to_string(t.topo.globalRank) + " (local " + std::to_string(t.topo.localRank) + "), device " +
        teacherDevice(cfg_.teacher, t.topo.teacherIndex) + ", serves students local " + locals + " (ranks " + globals +
        ")\n";
  }
  return out;
}

void Supervisor::createSegment(const std::string& segment, const std::string& jobId) {
  const RunOptions& run = cfg_.run;
  const int teachers = cfg_.teacher.procs, students = run.nproc_per_node - teachers;
  // A distill-run that was SIGKILLed could not remove its segment: the next run does.
  for (auto& stale : ipc::Segment::removeStale("distill-"))
    DISTILL_LOG(kWarning) << "removed stale segment /dev/shm/" << stale << ": its distill-run is gone";
  seg_ = ipc::Segment::create(segment, ipc::SegmentLayout::fromConfig(cfg_, students, teachers), jobId);
  segmentName_ = segment;
  seg_->setTeacherMaxRestarts(cfg_.teacher.max_restarts);
  DISTILL_LOG(kInfo) << "job " << jobId << ": " << students << " student(s) + " << teachers << " teacher(s) on node "
                     << node_ << "/" << run.nnodes << ", segment /dev/shm/" << segment << ", logs in " << run.log_dir;
  if (teachers > 1) {
    std::string a = assignmentText();
    a.pop_back();
    DISTILL_LOG(kInfo) << "teacher pool:\n" << a;
  }
}

} // namespace distill::launcher
