#pragma once

// distill::init: what a trainer calls first.
//
//   int main(int argc, char** argv) {
//     distill::Session s = distill::init(argc, argv, {"data", "lr", "batch"});  // its trainer keys
//     if (s.isTeacher()) return distill::serve(*s.teacher, myTeacher), 0;  // teacher.kind self
//     ... s.client->submit(...), s.student->group().allReduce(...) ...
//   }
//
// Environment (topology) + config (--config / DISTILL_CONFIG, DISTILL_SET,
// --set; removed from argv) -> a student or teacher session. Before this
// process waits on any other, the trainer's own section is checked (InitOptions):
// a typo or a bad value there ends this rank at once with the message, not
// after admission. Then a student attaches to its node's segment and waits
// until the teacher admitted every local student (the teacher compares each
// student's config with its own first: a difference is a ConfigError naming
// the keys), and only then joins the student group: no student enters a
// collective before all are admitted.
//
// init also installs exitOnUncaughtError() (core/errors.h): a distill::Error
// the trainer does not catch ends the rank with its message and exit code 2,
// which distill-run's summary shows, instead of SIGABRT.

#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distill/core/context.h"
#include "distill/group/student_context.h"
#include "distill/core/options.h"
#include "distill/core/topology.h"
#include "distill/student/client.h"

namespace distill {

struct Session {
  Topology topology;
  Config config;
  std::unique_ptr<Client> client; // students only
  std::unique_ptr<StudentContext> student; // students only: the student group lives here
  std::unique_ptr<TeacherContext> teacher; // the teacher rank only
  bool isTeacher() const { return teacher != nullptr; }
};

// What init checks of the trainer's own config section before this process
// waits on any other (segment, admission, student group). Both run in every
// process of the job, the teacher's too (teacher.kind self), in this order.
struct InitOptions {
  InitOptions() = default;
  InitOptions(std::vector<std::string> keys) : trainerKeys(std::move(keys)) {} // NOLINT: implicit
  InitOptions(std::initializer_list<std::string> keys) : trainerKeys(std::vector<std::string>(keys)) {} // NOLINT

  // The keys of the trainer section the trainer knows: any other is a
  // ConfigError naming it and the nearest known one (TrainerOptions::expectOnly).
  // Unset: init does not check the keys (the trainer may, later).
  std::optional<std::vector<std::string>> trainerKeys;
  // Reads and checks the trainer's own values (ranges, types): throw
  // ConfigError (TrainerOptions' getters do) for a bad one.
  std::function<void(const Config&)> validate;
};

Session init(int& argc, char** argv, const InitOptions& options = {});

} // namespace distill
