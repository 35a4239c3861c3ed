#pragma once

// What the teacher process is in a distill job: TeacherContext.
//
// A student's context, StudentContext, lives in the group module
// (distill/group/student_context.h) with the student group it hands out. The
// two are distinct types on purpose, and the teacher module may not include
// group/ (docs/design.md, "Layers"; tests/structure checks it): TeacherContext
// has no member that leads to a collective, so teacher code cannot enter one
// (docs/design.md, "The four hangs this design rules out": the checkpoint
// set-up hang) — a compile-time impossibility, not a runtime check.

#include <string>

#include "distill/core/options.h"
#include "distill/core/topology.h"

namespace distill {

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
