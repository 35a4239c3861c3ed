#pragma once

// Names inside checkpoint.dir, shared by the manager and the scan. Internal.
//
//   step_N.tmp/   being written; never loaded
//   step_N/       renamed from step_N.tmp once complete
//   latest        "step_N\n": the commit point. A checkpoint is published when
//                 `latest` names it (atomic rename of latest.tmp, fsynced
//                 directory); a step_N/ newer than `latest` was interrupted
//                 between its rename and that one, and is not loaded.

#include <cstdint>
#include <string>

namespace distill::ckpt_layout {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kModel = "model.pt";
constexpr const char* kOptimizer = "optimizer.pt";
constexpr const char* kTrain = "train_state.pt";
constexpr const char* kConfig = "config.yaml"; // dumpConfig() of the run that saved it
constexpr const char* kLatest = "latest";

inline std::string rankFile(int r) { return "rank_" + std::to_string(r) + ".pt"; }
inline std::string stepName(int64_t step) { return "step_" + std::to_string(step); }

// "step_12" -> 12, "step_12.tmp" -> 12 with *tmp set; -1 for anything else.
inline int64_t parseStepName(const std::string& name, bool* tmp) {
  if (name.rfind("step_", 0) != 0) return -1;
  std::string rest = name.substr(5);
  *tmp = rest.size() > 4 && rest.compare(rest.size() - 4, 4, ".tmp") == 0;
  if (*tmp) rest.resize(rest.size() - 4);
  if (rest.empty() || rest.size() > 18 || rest.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(rest);
}

} // namespace distill::ckpt_layout
