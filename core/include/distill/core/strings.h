#pragma once

// Small text helpers shared by the modules, the launcher and the examples
// (file-system helpers: core/sys.h).

#include <string>
#include <vector>

namespace distill {

// `items` separated by `sep`: "a, b, c"; "" when there are none.
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");
std::string join(const std::vector<int>& items, const std::string& sep = ", ");

// `text` without C++ source locations: gloo's and c10d's in brackets
// ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] ", "[enforce fail
// at .../pair.cc:456] ") with one space after, and distill's own in parentheses
// (" (job_store.cpp:205)", a distill error quoted inside another's message) with
// one space before. A bracket or parenthesis goes when its text ends in a
// source file's name, a colon and a line number; others ("[127.0.0.1]:4995") stay.
std::string withoutSourceLocations(std::string text);

} // namespace distill
