#pragma once

// Small text helpers shared by the modules, the launcher and the examples
// (file-system helpers: core/sys.h).

#include <string>
#include <vector>

namespace distill {

// `items` separated by `sep`: "a, b, c"; "" when there are none.
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");
std::string join(const std::vector<int>& items, const std::string& sep = ", ");

// `text` without the C++ source locations that gloo's and c10d's messages carry
// in brackets ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] ",
// "[enforce fail at .../pair.cc:456] "): a bracket whose text ends in a source
// file's name, a colon and a line number goes, with one space after it. Other
// brackets ("[127.0.0.1]:4995") stay.
std::string withoutSourceLocations(std::string text);

} // namespace distill
