#pragma once

// main() of distill-teacher, declared apart from server.h so that the program's
// main.cpp compiles without torch's headers.

namespace distill {

// Config from --config/DISTILL_CONFIG and --set, topology from the
// environment; returns the process exit code.
int teacherMain(int argc, char** argv);

} // namespace distill
