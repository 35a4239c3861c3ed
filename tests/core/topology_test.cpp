#include <gtest/gtest.h>

#include "distill/core/errors.h"
#include "distill/core/topology.h"

using distill::Role;
using distill::Topology;
using Env = std::map<std::string, std::string>;

namespace {

// The environment distill-run gives local rank `local` of node `node`.
Env launcherEnv(int node, int nnodes, int local, int perNode) {
  Topology t = Topology::forLocalRank(node, nnodes, local, perNode);
  t.masterPort = 29555;
  t.segment = "distill-abc";
  t.jobId = "abc";
  return distill::topologyEnv(t);
}

std::string errorOf(const Env& env) {
  try {
    Topology::fromEnv(env);
  } catch (const distill::ConfigError& e) {
    return e.message();
  }
  return "";
}

} // namespace

TEST(Topology, ForLocalRankMatchesWhatTheEnvironmentGives) {
  // 2 nodes x 4: node 1, local 1 is global 5 and student 4 of 6.
  Topology t = Topology::forLocalRank(1, 2, 1, 4);
  EXPECT_TRUE(t.isStudent());
  EXPECT_EQ(t.globalRank, 5);
  EXPECT_EQ(t.globalWorldSize, 8);
  EXPECT_EQ(t.studentRank, 4);
  EXPECT_EQ(t.studentLocalRank, 1);
  EXPECT_EQ(t.studentWorldSize, 6);
  EXPECT_TRUE(Topology::forLocalRank(1, 2, 3, 4).isTeacher());
  EXPECT_EQ(Topology::forLocalRank(1, 2, 3, 4).studentRank, -1);
}

TEST(Topology, SingleNodeFromLauncher) {
  for (int local = 0; local < 4; ++local) {
    Topology t = Topology::fromEnv(launcherEnv(0, 1, local, 4));
    EXPECT_EQ(t.localWorldSize, 4);
    EXPECT_EQ(t.studentWorldSize, 3);
    EXPECT_EQ(t.globalRank, local);
    if (local == 3) {
      EXPECT_TRUE(t.isTeacher());
      EXPECT_EQ(t.studentRank, -1);
      EXPECT_EQ(t.teacherGlobalRank(), 3);
    } else {
      EXPECT_TRUE(t.isStudent());
      EXPECT_EQ(t.studentRank, local);
      EXPECT_EQ(t.studentLocalRank, local);
    }
    EXPECT_EQ(t.segment, "distill-abc");
  }
}

TEST(Topology, MultiNodeFromLauncher) {
  // 2 nodes x 4 processes: students 0,1,2 on node 0 and 3,4,5 on node 1.
  Topology s = Topology::fromEnv(launcherEnv(1, 2, 1, 4));
  EXPECT_TRUE(s.isStudent());
  EXPECT_EQ(s.globalRank, 5);
  EXPECT_EQ(s.studentRank, 4);
  EXPECT_EQ(s.studentWorldSize, 6);
  EXPECT_EQ(s.teacherGlobalRank(), 7);
  Topology t = Topology::fromEnv(launcherEnv(1, 2, 3, 4));
  EXPECT_TRUE(t.isTeacher());
  EXPECT_EQ(t.globalRank, 7);
  // The student world a trainer sees is the students only.
  Env e = launcherEnv(1, 2, 2, 4);
  EXPECT_EQ(e.at("RANK"), "5");
  EXPECT_EQ(e.at("WORLD_SIZE"), "6");
  EXPECT_EQ(e.at("LOCAL_WORLD_SIZE"), "3");
  EXPECT_EQ(launcherEnv(1, 2, 3, 4).count("RANK"), 0u);
}

TEST(Topology, FromTorchrun) {
  // torchrun: every process in RANK/WORLD_SIZE; the last local rank is the teacher.
  Env e{{"RANK", "6"},       {"WORLD_SIZE", "8"},         {"LOCAL_RANK", "2"},     {"LOCAL_WORLD_SIZE", "4"},
        {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}};
  Topology t = Topology::fromEnv(e);
  EXPECT_TRUE(t.isStudent());
  EXPECT_EQ(t.nnodes, 2);
  EXPECT_EQ(t.studentRank, 5);
  EXPECT_EQ(t.studentWorldSize, 6);
  EXPECT_EQ(t.masterAddr, "10.0.0.1");
  e["RANK"] = "7";
  e["LOCAL_RANK"] = "3";
  EXPECT_TRUE(Topology::fromEnv(e).isTeacher());
}

TEST(Topology, EmptyEnvironmentListsEveryMissingVariable) {
  std::string msg = errorOf({});
  EXPECT_NE(msg.find("RANK is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("WORLD_SIZE is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("LOCAL_RANK is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("LOCAL_WORLD_SIZE is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MASTER_PORT is not set"), std::string::npos) << msg;
  EXPECT_NE(msg.find("5 problems"), std::string::npos) << msg;
}

TEST(Topology, BadEnvironments) {
  struct Case {
    const char* what;
    Env env;
    const char* expected;
  };
  Env good = launcherEnv(0, 1, 1, 3);
  auto with = [&](Env e, const std::string& k, const std::string& v) {
    e[k] = v;
    return e;
  };
  auto without = [&](Env e, const std::string& k) {
    e.erase(k);
    return e;
  };
  std::vector<Case> cases = {
      {"bad role", with(good, "DISTILL_ROLE", "teach"), "DISTILL_ROLE=\"teach\" is neither student nor teacher"},
      {"teacher not last", with(good, "DISTILL_ROLE", "teacher"),
       "a teacher must be the last local rank (2), found local rank 1"},
      {"student on teacher slot", with(with(good, "DISTILL_LOCAL_RANK", "2"), "LOCAL_RANK", "2"),
       "local rank 2 is a teacher's (the last local rank (2)) but DISTILL_ROLE=student"},
      {"not a number", with(good, "DISTILL_LOCAL_WORLD_SIZE", "three"),
       "DISTILL_LOCAL_WORLD_SIZE=\"three\" is not an integer >= 2"},
      {"one process per node", with(good, "DISTILL_LOCAL_WORLD_SIZE", "1"),
       "DISTILL_LOCAL_WORLD_SIZE=\"1\" is not an integer >= 2"},
      {"node beyond nnodes", with(good, "DISTILL_NODE_RANK", "1"), "node rank 1 is not below the node count 1"},
      {"student RANK disagrees", with(good, "RANK", "0"), "RANK=0 but the student world of DISTILL_* gives 1"},
      {"student WORLD_SIZE disagrees", with(good, "WORLD_SIZE", "3"),
       "WORLD_SIZE=3 but the student world of DISTILL_* gives 2"},
      {"missing port", without(good, "MASTER_PORT"), "MASTER_PORT is not set"},
      {"torchrun world not multiple",
       {{"RANK", "0"}, {"WORLD_SIZE", "7"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_PORT", "1"}},
       "WORLD_SIZE=7 is not a multiple of LOCAL_WORLD_SIZE=4"},
      {"torchrun rank mismatch",
       {{"RANK", "5"},
        {"WORLD_SIZE", "8"},
        {"LOCAL_RANK", "0"},
        {"LOCAL_WORLD_SIZE", "4"},
        {"NODE_RANK", "0"},
        {"MASTER_PORT", "1"}},
       "RANK=5 does not match NODE_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK=0"},
  };
  for (auto& c : cases) {
    std::string msg = errorOf(c.env);
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.what << ": expected \"" << c.expected << "\" in:\n" << msg;
  }
}

// A pool of 2 teachers on 2 nodes of 6: 4 students per node, student local i
// served by local rank 4 + i % 2; the environment round-trips it; a process
// started for another pool size than the config's is refused, naming both.
TEST(Topology, PoolOfTwoTeachersPerNode) {
  Topology s = Topology::forLocalRank(1, 2, 3, 6, 2);
  EXPECT_TRUE(s.isStudent());
  EXPECT_EQ(s.studentsPerNode(), 4);
  EXPECT_EQ(s.studentRank, 7);
  EXPECT_EQ(s.studentWorldSize, 8);
  EXPECT_EQ(s.teacherLocalRankOf(3), 5);
  EXPECT_EQ(s.teacherGlobalRank(), 11);
  Topology t = Topology::forLocalRank(1, 2, 4, 6, 2);
  EXPECT_TRUE(t.isTeacher());
  EXPECT_EQ(t.teacherIndex, 0);
  EXPECT_EQ(t.studentRank, -1);
  for (int local = 0; local < 6; ++local) {
    Topology a = Topology::forLocalRank(0, 1, local, 6, 2);
    a.masterPort = 29555, a.segment = "distill-abc", a.jobId = "abc";
    Topology b = Topology::fromEnv(distill::topologyEnv(a));
    EXPECT_EQ(b.role, a.role) << local;
    EXPECT_EQ(b.teachersPerNode, 2) << local;
    EXPECT_EQ(b.teacherIndex, a.teacherIndex) << local;
    EXPECT_EQ(b.studentRank, a.studentRank) << local;
  }
  EXPECT_NO_THROW(s.checkTeachers(2));
  try {
    s.checkTeachers(3);
    FAIL() << "no ConfigError";
  } catch (const distill::ConfigError& e) {
    EXPECT_NE(e.message().find("teacher.procs is 3 but this process was started for 2 teacher(s) per node"),
              std::string::npos)
        << e.message();
  }
}
