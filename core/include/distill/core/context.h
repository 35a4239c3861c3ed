#pragma once

// What a process is in a distill job: a student or the teacher of its node.
//
// The two are distinct types on purpose. Only StudentContext can hand out the
// StudentGroup; TeacherContext has no member that leads to a collective, so
// teacher code cannot enter one (docs/design.md, "The four hangs this design rules out":
// the checkpoint set-up hang) — a compile-time impossibility, not a runtime check.
// Checkpoint and gradient helpers take a StudentContext& and nothing else.

#include <memory>

#include "distill/core/options.h"
#include "distill/core/topology.h"

namespace distill {

class StudentGroup;

class StudentContext {
 public:
  // Joins the student group (rendezvous bounded by run.startup_timeout_s).
  // Throws ConfigError if `topo` is not a student's.
  StudentContext(Topology topo, Config config);
  ~StudentContext();
  StudentContext(const StudentContext&) = delete;
  StudentContext& operator=(const StudentContext&) = delete;

  const Topology& topology() const { return topo_; }
  const Config& config() const { return config_; }
  int rank() const { return topo_.studentRank; }
  int worldSize() const { return topo_.studentWorldSize; }
  // The students' process group; the only way to one.
  StudentGroup& group() { return *group_; }

 private:
  Topology topo_;
  Config config_;
  std::unique_ptr<StudentGroup> group_;
};

class TeacherContext {
 public:
  // Throws ConfigError if `topo` is not a teacher's. Joins nothing.
  TeacherContext(Topology topo, Config config);

  const Topology& topology() const { return topo_; }
  const Config& config() const { return config_; }
  // The device this teacher runs on: teacher.devices[its index] in a pool
  // (teacher.procs > 1), else teacher.device. A `self` teacher loads its model there.
  std::string device() const { return teacherDevice(config_.teacher, topo_.teacherIndex); }

 private:
  Topology topo_;
  Config config_;
};

} // namespace distill
