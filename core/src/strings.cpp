#include "distill/core/strings.h"

#include <cstdio>

namespace distill {

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : std::string()) + items[i];
  return out;
}

std::string join(const std::vector<int>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : std::string()) + std::to_string(items[i]);
  return out;
}

} // namespace distill
