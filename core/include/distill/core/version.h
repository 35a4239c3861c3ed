#pragma once

// The version of distill, one for the whole project: CMakeLists.txt's
// project(distill VERSION x.y.z), which pip's package version and
// distill.__version__ also read (CHANGELOG.md).
//
// DISTILL_VERSION (distill/build_config.h) is the version of the headers a
// program was compiled against; version() is the version of the distill
// library the program runs with (they differ only when a program built against
// one install loads another's libraries). distill-run --version and
// distill-teacher --version print version().

namespace distill {

// "x.y.z", the loaded library's. Any thread.
const char* version();

} // namespace distill
