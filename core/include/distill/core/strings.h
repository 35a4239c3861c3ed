#pragma once

// Small text and file-system helpers shared by the modules, the launcher and
// the examples. POSIX calls only: no std::filesystem (libtorch.so exports its
// own copy of it, and a call bound to that copy crashed; README, build notes).

#include <string>
#include <vector>

namespace distill {

// `items` separated by `sep`: "a, b, c"; "" when there are none.
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");
std::string join(const std::vector<int>& items, const std::string& sep = ", ");

// mkdir -p `dir` (mode 0755). Returns 0, or the errno of the first directory
// that could not be made, with its path in `*failedAt`.
int makeDirs(const std::string& dir, std::string* failedAt = nullptr);

}  // namespace distill
