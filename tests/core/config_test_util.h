#pragma once

// What config_test's sources share: the smallest valid file and the problem
// lines of the ConfigError a YAML text gives.

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "distill/core/config.h"
#include "distill/core/errors.h"

namespace config_testing {

using distill::Config;
using distill::ConfigError;
using distill::parseConfig;

// Smallest valid file: the one required key.
inline const std::string kSelf = "teacher:\n  kind: self\n";

inline std::vector<std::string> splitLines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The problem lines of the ConfigError parsing `yaml` throws (the header checked).
inline std::vector<std::string> problemsOf(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parseConfig(yaml, overrides);
  } catch (const ConfigError& e) {
    std::vector<std::string> lines = splitLines(e.message());
    if (lines.empty()) {
      ADD_FAILURE() << "empty message";
      return {};
    }
    EXPECT_EQ(lines[0], "config <string>: " + std::to_string(lines.size() - 1) + " problem(s):");
    return {lines.begin() + 1, lines.end()};
  }
  ADD_FAILURE() << "no ConfigError for:\n" << yaml;
  return {};
}

inline Config selfDefaults() {
  Config c;
  c.teacher.kind = distill::TeacherKind::kSelf;
  return c;
}

struct BadCase {
  std::string yaml;
  std::string problem;
};

} // namespace config_testing
