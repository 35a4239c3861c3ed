#include "distill/core/strings.h"

#include <sys/stat.h>

#include <cerrno>

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

int makeDirs(const std::string& dir, std::string* failedAt) {
  std::string cur = !dir.empty() && dir[0] == '/' ? "/" : "";
  for (size_t start = 0; start <= dir.size();) {
    size_t end = dir.find('/', start);
    if (end == std::string::npos) end = dir.size();
    if (end > start) {
      cur += dir.substr(start, end - start) + "/";
      if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
        const int err = errno;
        if (failedAt) *failedAt = cur;
        return err;
      }
    }
    start = end + 1;
  }
  return 0;
}

}  // namespace distill
