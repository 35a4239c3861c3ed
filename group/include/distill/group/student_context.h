#pragma once

// What a student process is in a distill job: StudentContext, the only way to
// the student group. Checkpoint and gradient helpers take a StudentContext&
// and nothing else. The teacher's context is TeacherContext
// (distill/core/context.h), which leads to no collective.

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

} // namespace distill
