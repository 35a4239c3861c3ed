#pragma once

// Small text helpers shared by the modules, the launcher and the examples
// (file-system helpers: core/sys.h).

#include <string>
#include <vector>

namespace distill {

// `items` separated by `sep`: "a, b, c"; "" when there are none.
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");
std::string join(const std::vector<int>& items, const std::string& sep = ", ");

} // namespace distill
