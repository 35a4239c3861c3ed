#include "distill/core/topology.h"

#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "distill/core/errors.h"

extern char** environ;

namespace distill {
namespace {

// Reads integers and strings from the variables, recording every problem
// instead of stopping at the first, so one error lists them all.
class EnvReader {
 public:
  explicit EnvReader(const std::map<std::string, std::string>& env) : env_(env) {}

  bool has(const std::string& k) const { return env_.count(k) > 0; }

  std::string str(const std::string& k, const std::string& fallback, bool required = false) {
    auto it = env_.find(k);
    if (it == env_.end() || it->second.empty()) {
      if (required) problems_.push_back(k + " is not set");
      return fallback;
    }
    return it->second;
  }

  int integer(const std::string& k, int fallback, bool required, int minValue) {
    auto it = env_.find(k);
    if (it == env_.end() || it->second.empty()) {
      if (required) problems_.push_back(k + " is not set");
      return fallback;
    }
    const std::string& v = it->second;
    char* end = nullptr;
    errno = 0;
    long x = std::strtol(v.c_str(), &end, 10);
    if (errno != 0 || end == v.c_str() || *end != '\0' || x < minValue || x > 1 << 24) {
      problems_.push_back(k + "=\"" + v + "\" is not an integer >= " + std::to_string(minValue));
      return fallback;
    }
    return static_cast<int>(x);
  }

  void problem(std::string p) { problems_.push_back(std::move(p)); }
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  const std::map<std::string, std::string>& env_;
  std::vector<std::string> problems_;
};

Role parseRole(EnvReader& r, const std::string& v) {
  if (v == "student") return Role::kStudent;
  if (v == "teacher") return Role::kTeacher;
  r.problem("DISTILL_ROLE=\"" + v + "\" is neither student nor teacher");
  return Role::kUnknown;
}

} // namespace

std::string Topology::describe() const {
  std::ostringstream os;
  os << roleName(role) << " node " << nodeRank << "/" << nnodes << " local " << localRank << "/" << localWorldSize
     << " global " << globalRank << "/" << globalWorldSize;
  if (isStudent()) os << " student " << studentRank << "/" << studentWorldSize;
  if (isTeacher() && teachersPerNode > 1) os << " teacher " << teacherIndex << "/" << teachersPerNode;
  if (!segment.empty()) os << " segment " << segment;
  return os.str();
}

Topology Topology::forLocalRank(int nodeRank, int nnodes, int localRank, int localWorldSize, int teachers) {
  Topology t;
  t.teachersPerNode = teachers;
  t.role = localRank >= localWorldSize - teachers ? Role::kTeacher : Role::kStudent;
  t.nodeRank = nodeRank;
  t.nnodes = nnodes;
  t.localRank = localRank;
  t.localWorldSize = localWorldSize;
  t.globalRank = nodeRank * localWorldSize + localRank;
  t.globalWorldSize = nnodes * localWorldSize;
  t.studentWorldSize = nnodes * t.studentsPerNode();
  if (t.isStudent()) {
    t.studentLocalRank = localRank;
    t.studentRank = t.studentRankOf(nodeRank, localRank);
  } else {
    t.teacherIndex = localRank - t.studentsPerNode();
  }
  return t;
}

Topology Topology::fromEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string key = kv.substr(0, eq);
    if (key.rfind("DISTILL_", 0) == 0 || key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" ||
        key == "LOCAL_WORLD_SIZE" || key == "NODE_RANK" || key == "GROUP_RANK" || key == "MASTER_ADDR" ||
        key == "MASTER_PORT") {
      env[key] = kv.substr(eq + 1);
    }
  }
  return fromEnv(env);
}

namespace {

// Launched by distill-run: DISTILL_* is the full picture.
void readDistillRun(EnvReader& r, Topology& t) {
  t.role = parseRole(r, r.str("DISTILL_ROLE", ""));
  t.localRank = r.integer("DISTILL_LOCAL_RANK", 0, true, 0);
  t.localWorldSize = r.integer("DISTILL_LOCAL_WORLD_SIZE", 0, true, 2);
  t.nodeRank = r.integer("DISTILL_NODE_RANK", 0, true, 0);
  t.nnodes = r.integer("DISTILL_NNODES", 1, true, 1);
  t.teachersPerNode = r.integer("DISTILL_TEACHERS", 1, false, 1);
  t.masterPort = r.integer("MASTER_PORT", 0, t.role == Role::kStudent, 1);
}

// Launched by torchrun: every process in RANK/WORLD_SIZE, teacher = last local rank.
void readTorchrun(EnvReader& r, Topology& t) {
  t.torchrun = true;
  int rank = r.integer("RANK", 0, true, 0);
  int world = r.integer("WORLD_SIZE", 0, true, 1);
  t.localRank = r.integer("LOCAL_RANK", 0, true, 0);
  t.localWorldSize = r.integer("LOCAL_WORLD_SIZE", 0, true, 2);
  const char* nodeKey = r.has("NODE_RANK") ? "NODE_RANK" : "GROUP_RANK";
  t.nodeRank = r.integer(nodeKey, 0, false, 0);
  t.masterPort = r.integer("MASTER_PORT", 0, true, 1);
  if (t.localWorldSize >= 2 && world % t.localWorldSize != 0) {
    r.problem("WORLD_SIZE=" + std::to_string(world) + " is not a multiple of LOCAL_WORLD_SIZE=" +
              std::to_string(t.localWorldSize) + " (every node needs the same process count)");
  } else if (t.localWorldSize >= 2) {
    t.nnodes = world / t.localWorldSize;
  }
  if (t.localWorldSize >= 2 && rank != t.nodeRank * t.localWorldSize + t.localRank) {
    r.problem("RANK=" + std::to_string(rank) + " does not match NODE_RANK*LOCAL_WORLD_SIZE+" +
              "LOCAL_RANK=" + std::to_string(t.nodeRank * t.localWorldSize + t.localRank));
  }
  t.teachersPerNode = r.integer("DISTILL_TEACHERS", 1, false, 1);
  t.role = t.localRank >= t.localWorldSize - t.teachersPerNode ? Role::kTeacher : Role::kStudent;
}

// The ranks against the sizes, and the role against the local rank.
void checkRanks(EnvReader& r, const Topology& t) {
  if (t.localWorldSize >= 2 && t.localRank >= t.localWorldSize) {
    r.problem("local rank " + std::to_string(t.localRank) + " is not below the local world size " +
              std::to_string(t.localWorldSize));
  }
  if (t.nodeRank >= t.nnodes) {
    r.problem("node rank " + std::to_string(t.nodeRank) + " is not below the node count " + std::to_string(t.nnodes));
  }
  const int k = t.teachersPerNode;
  if (t.localWorldSize >= 2 && k >= t.localWorldSize) {
    r.problem("DISTILL_TEACHERS=" + std::to_string(k) + " leaves no student among the " +
              std::to_string(t.localWorldSize) + " processes of a node");
    return;
  }
  const bool teacherRank = t.localRank >= t.localWorldSize - k;
  const std::string teachers = k == 1 ? "the last local rank (" + std::to_string(t.localWorldSize - 1) + ")"
                                      : "the last " + std::to_string(k) + " local ranks (" +
          std::to_string(t.localWorldSize - k) + ".." + std::to_string(t.localWorldSize - 1) + ")";
  if (t.role == Role::kTeacher && !teacherRank) {
    r.problem("a teacher must be " + teachers + ", found local rank " + std::to_string(t.localRank));
  }
  if (t.role == Role::kStudent && teacherRank) {
    r.problem("local rank " + std::to_string(t.localRank) + " is a teacher's (" + teachers +
              ") but DISTILL_ROLE=student");
  }
}

// The student-world variables distill-run sets must agree with DISTILL_*.
void checkStudentWorld(EnvReader& r, const Topology& t) {
  struct {
    const char* key;
    int expected;
  } checks[] = {{"RANK", t.studentRank},
                {"WORLD_SIZE", t.studentWorldSize},
                {"LOCAL_RANK", t.studentLocalRank},
                {"LOCAL_WORLD_SIZE", t.studentsPerNode()}};
  for (auto& c : checks) {
    int v = r.integer(c.key, c.expected, true, 0);
    if (r.has(c.key) && v != c.expected) {
      r.problem(std::string(c.key) + "=" + std::to_string(v) + " but the student world of " + "DISTILL_* gives " +
                std::to_string(c.expected));
    }
  }
}

} // namespace

Topology Topology::fromEnv(const std::map<std::string, std::string>& env) {
  EnvReader r(env);
  Topology t;
  t.masterAddr = r.str("MASTER_ADDR", "127.0.0.1");
  t.segment = r.str("DISTILL_SEGMENT", "");
  t.jobId = r.str("DISTILL_JOB_ID", "");
  t.configPath = r.str("DISTILL_CONFIG", "");
  if (r.has("DISTILL_ROLE")) {
    readDistillRun(r, t);
  } else {
    readTorchrun(r, t);
  }
  checkRanks(r, t);

  t.globalWorldSize = t.nnodes * t.localWorldSize;
  t.globalRank = t.nodeRank * t.localWorldSize + t.localRank;
  t.studentWorldSize = t.nnodes * t.studentsPerNode();
  if (t.role == Role::kStudent) {
    t.studentLocalRank = t.localRank;
    t.studentRank = t.studentRankOf(t.nodeRank, t.localRank);
    if (r.has("DISTILL_ROLE")) checkStudentWorld(r, t);
  } else if (t.role == Role::kTeacher) {
    t.teacherIndex = t.localRank - t.studentsPerNode();
  }

  if (!r.problems().empty()) {
    std::ostringstream os;
    os << "bad distill environment (" << r.problems().size() << " problem" << (r.problems().size() > 1 ? "s" : "")
       << "):";
    for (auto& p : r.problems()) os << "\n  " << p;
    DISTILL_THROW(ConfigError, os.str());
  }
  return t;
}

std::map<std::string, std::string> topologyEnv(const Topology& t) {
  std::map<std::string, std::string> env{
      {"DISTILL_ROLE", roleName(t.role)},
      {"DISTILL_LOCAL_RANK", std::to_string(t.localRank)},
      {"DISTILL_LOCAL_WORLD_SIZE", std::to_string(t.localWorldSize)},
      {"DISTILL_NODE_RANK", std::to_string(t.nodeRank)},
      {"DISTILL_NNODES", std::to_string(t.nnodes)},
      {"DISTILL_TEACHERS", std::to_string(t.teachersPerNode)},
      {"DISTILL_GLOBAL_RANK", std::to_string(t.globalRank)},
      {"DISTILL_GLOBAL_WORLD_SIZE", std::to_string(t.globalWorldSize)},
      {"MASTER_ADDR", t.masterAddr},
      {"MASTER_PORT", std::to_string(t.masterPort)},
  };
  if (!t.segment.empty()) env["DISTILL_SEGMENT"] = t.segment;
  if (!t.jobId.empty()) env["DISTILL_JOB_ID"] = t.jobId;
  if (!t.configPath.empty()) env["DISTILL_CONFIG"] = t.configPath;
  if (t.isStudent()) {
    env["RANK"] = std::to_string(t.studentRank);
    env["WORLD_SIZE"] = std::to_string(t.studentWorldSize);
    env["LOCAL_RANK"] = std::to_string(t.studentLocalRank);
    env["LOCAL_WORLD_SIZE"] = std::to_string(t.studentsPerNode());
    env["NODE_RANK"] = std::to_string(t.nodeRank);
  }
  return env;
}

void Topology::checkTeachers(int procs) const {
  DISTILL_CHECK_T(ConfigError, procs == teachersPerNode, "teacher.procs is ", procs,
                  " but this process was started for ", teachersPerNode,
                  " teacher(s) per node (DISTILL_TEACHERS=", teachersPerNode,
                  "): distill-run sets it from the config; a process started another way (torchrun) needs "
                  "DISTILL_TEACHERS=",
                  procs, " in its environment on every node");
}

} // namespace distill
