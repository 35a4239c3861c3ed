#pragma once

// Small text helpers shared by the modules, the launcher and the examples
// (file-system helpers: core/sys.h).

#include <string>

namespace distill {

// `s` as a JSON string literal: quotes, \" \\ \n \t, other control bytes as \u00XX.
std::string jsonQuote(const std::string& s);

}  // namespace distill
