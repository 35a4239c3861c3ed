#pragma once

// distill::init: what a trainer calls first.
//
//   int main(int argc, char** argv) {
//     distill::Session s = distill::init(argc, argv);
//     if (s.isTeacher()) return distill::serve(*s.teacher, myTeacher), 0;  // teacher.kind self
//     ... s.client->submit(...), s.student->group().allReduce(...) ...
//   }
//
// Environment (topology) + config (--config / DISTILL_CONFIG, DISTILL_SET,
// --set; removed from argv) -> a student or teacher session. A student first
// attaches to its node's segment and waits until the teacher admitted every
// local student, and only then joins the student group: no student enters a
// collective before all are admitted.

#include <memory>

#include "distill/core/context.h"
#include "distill/core/options.h"
#include "distill/core/topology.h"
#include "distill/student/client.h"

namespace distill {

struct Session {
  Topology topology;
  Config config;
  std::unique_ptr<Client> client;           // students only
  std::unique_ptr<StudentContext> student;  // students only: the student group lives here
  std::unique_ptr<TeacherContext> teacher;  // the teacher rank only
  bool isTeacher() const { return teacher != nullptr; }
};

Session init(int& argc, char** argv);

}  // namespace distill
