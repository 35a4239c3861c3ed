#pragma once

// Child roles of a test binary, for tests that fork+exec themselves.
//
//   DISTILL_TEST_ROLE(student) { ...; return 0; }      // in a test file
//   spawnRole("student", {"--steps=3"}, env)           // runs it in a new process
//
// The test binary's main (support/main.cpp) runs the role named by
// --distill-role=NAME instead of the tests; its return value is the exit code.
// Exec'ing (not just forking) is required for anything that may touch CUDA.

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "support/process.h"

namespace distill::testing {

using RoleFn = std::function<int(const std::vector<std::string>& args)>;

bool registerRole(const std::string& name, RoleFn fn);

// Path of the running test binary (/proc/self/exe).
std::string selfExe();

// fork+exec this test binary in role `name` with extra args and environment.
Child spawnRole(const std::string& name, const std::vector<std::string>& args = {},
                const std::map<std::string, std::string>& env = {}, const std::string& logPath = {});

// Called by main(): runs the role if argv names one; returns -1 otherwise.
int runRoleIfRequested(int argc, char** argv);

} // namespace distill::testing

#define DISTILL_TEST_ROLE(name)                                                                          \
  static int distillRole_##name(const std::vector<std::string>& args);                                   \
  static const bool distillRoleReg_##name = ::distill::testing::registerRole(#name, distillRole_##name); \
  static int distillRole_##name([[maybe_unused]] const std::vector<std::string>& args)
