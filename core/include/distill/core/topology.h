#pragma once

// Who is who in a distill job, read from the environment.
//
// Two launchers are understood:
//  * distill-run sets DISTILL_ROLE and the other DISTILL_* variables for the
//    full picture, and torchrun-compatible RANK / WORLD_SIZE / LOCAL_RANK /
//    LOCAL_WORLD_SIZE describing the STUDENT world only (absent for the
//    teacher), so that an existing trainer shards its data unchanged.
//  * torchrun (no DISTILL_ROLE): RANK / WORLD_SIZE / ... describe every process;
//    the last local rank of each node is its teacher (the last DISTILL_TEACHERS
//    when that is set), the others are students.
//
// A teacher pool (teacher.procs K, DISTILL_TEACHERS): the last K local ranks of
// each node are its teachers; local student i is served by teacher i % K
// (teacherLocalRankOf), so the loads differ by at most one student.
//
// Every problem with the environment is collected into one ConfigError.

#include <map>
#include <string>

#include "distill/core/logging.h"

namespace distill {

struct Topology {
  Role role = Role::kUnknown;
  int nodeRank = 0; // this node
  int nnodes = 1; // nodes in the job
  int localRank = 0; // among all processes of this node (teachers: the last teachersPerNode)
  int localWorldSize = 0; // processes per node, teachers included
  int teachersPerNode = 1; // teacher processes per node (teacher.procs)
  int teacherIndex = -1; // a teacher: which of its node's teachers, 0 .. teachersPerNode-1; -1 for a student
  int globalRank = 0; // among all processes of the job
  int globalWorldSize = 0; // nnodes * localWorldSize
  int studentRank = -1; // among the students of the job (-1 for a teacher)
  int studentWorldSize = 0; // nnodes * studentsPerNode()
  int studentLocalRank = -1; // among the students of this node (-1 for a teacher)
  std::string masterAddr = "127.0.0.1"; // student group rendezvous (student rank 0's host)
  int masterPort = 0;
  std::string segment; // this node's shared-memory segment name ("" if none)
  std::string jobId; // random id of the job
  std::string configPath; // DISTILL_CONFIG ("" if none)
  bool torchrun = false; // started by torchrun (no DISTILL_ROLE): ipc/torchrun.h makes the segment

  bool isTeacher() const { return role == Role::kTeacher; }
  bool isStudent() const { return role == Role::kStudent; }
  int studentsPerNode() const { return localWorldSize - teachersPerNode; }
  // Local rank of the teacher that serves local student `studentLocal`.
  int teacherLocalRankOf(int studentLocal) const { return studentsPerNode() + studentLocal % teachersPerNode; }
  // Global rank of the teacher serving this student (a teacher: its own).
  int teacherGlobalRank() const {
    return nodeRank * localWorldSize + (isTeacher() ? localRank : teacherLocalRankOf(studentLocalRank));
  }
  // Student rank of local student `i` of node `node`.
  int studentRankOf(int node, int i) const { return node * studentsPerNode() + i; }
  Identity identity() const { return Identity{nodeRank, globalRank, role}; }
  // One line: "node 0/1 local 2/3 global 2/3 teacher ...".
  std::string describe() const;

  // The topology of local rank `localRank` of node `nodeRank` in a job of
  // `nnodes` nodes with `localWorldSize` processes each (the last `teachers`
  // local ranks are teachers); what distill-run gives each process it starts.
  // Rendezvous, segment and config fields are left for the caller.
  static Topology forLocalRank(int nodeRank, int nnodes, int localRank, int localWorldSize, int teachers = 1);

  // Reads the process environment.
  static Topology fromEnvironment();
  // Reads the given variables (tests, the launcher's --dry-run).
  static Topology fromEnv(const std::map<std::string, std::string>& env);

  // ConfigError unless this process was started for `procs` teachers per node
  // (teacher.procs): distill-run sets DISTILL_TEACHERS from the config; a
  // process started another way (torchrun) must be told the same.
  void checkTeachers(int procs) const;
};

// The variables distill-run gives one process of a job (students get the
// torchrun-compatible student-world ones too).
std::map<std::string, std::string> topologyEnv(const Topology& t);

} // namespace distill
