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

namespace {

// Whether `inside` ends in "<name>.<source extension>:<line number>".
bool endsInSourceLocation(const std::string& inside) {
  static const std::string kExtensions[] = {".cc:", ".cpp:", ".cxx:", ".cu:", ".c:", ".h:", ".hpp:"};
  for (const auto& ext : kExtensions) {
    const size_t at = inside.rfind(ext);
    if (at == std::string::npos || at == 0) continue;
    const size_t digits = at + ext.size();
    if (digits < inside.size() && std::all_of(inside.begin() + static_cast<std::ptrdiff_t>(digits), inside.end(),
                                              [](unsigned char c) { return std::isdigit(c); }))
      return true;
  }
  return false;
}

// Drops each `open`...`close` span whose text is a source location, with one
// space after it (`spaceAfter`) or before it.
void dropLocations(std::string& text, char open, char close, bool spaceAfter) {
  size_t start = 0;
  while ((start = text.find(open, start)) != std::string::npos) {
    const size_t end = text.find(close, start);
    if (end == std::string::npos) return;
    if (!endsInSourceLocation(text.substr(start + 1, end - start - 1))) {
      start = end + 1;
      continue;
    }
    size_t from = start, to = end + 1;
    if (spaceAfter && to < text.size() && text[to] == ' ') ++to;
    if (!spaceAfter && from > 0 && text[from - 1] == ' ') --from;
    text.erase(from, to - from);
    start = from;
  }
}

} // namespace

std::string withoutSourceLocations(std::string text) {
  dropLocations(text, '[', ']', true);
  dropLocations(text, '(', ')', false);
  return text;
}

} // namespace distill
