#include "distill/core/strings.h"

#include <algorithm>
#include <cctype>
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

std::string withoutSourceLocations(std::string text) {
  static const std::string kExtensions[] = {".cc:", ".cpp:", ".cxx:", ".cu:", ".c:", ".h:", ".hpp:"};
  size_t open = 0;
  while ((open = text.find('[', open)) != std::string::npos) {
    const size_t close = text.find(']', open);
    if (close == std::string::npos) break;
    const std::string inside = text.substr(open + 1, close - open - 1);
    bool located = false;
    for (const auto& ext : kExtensions) {
      const size_t at = inside.rfind(ext);
      const size_t digits = at == std::string::npos ? inside.size() : at + ext.size();
      located = digits < inside.size() && std::all_of(inside.begin() + static_cast<std::ptrdiff_t>(digits),
                                                      inside.end(), [](unsigned char c) { return std::isdigit(c); });
      if (located) break;
    }
    if (!located) {
      open = close + 1;
      continue;
    }
    const size_t end = close + 1 < text.size() && text[close + 1] == ' ' ? close + 2 : close + 1;
    text.erase(open, end - open);
  }
  return text;
}

} // namespace distill
