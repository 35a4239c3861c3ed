// distill._C: see bindings.h.
#include "bindings.h"

#include "distill/build_config.h"
#include "distill/core/version.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "distill's C++ engine (import distill, not this module)";
  distill::py::bindErrors(m);
  distill::py::bindSession(m);
  distill::py::bindClient(m);
  distill::py::bindSteps(m);
  distill::py::bindTeacher(m);
  distill::py::bindExit(m);
  m.attr("build_bin_dir") = DISTILL_PY_BUILD_BIN_DIR; // distill-run, distill-teacher of this build tree
  // The loaded library's version (CMakeLists.txt's project(VERSION)): distill.__version__, as
  // distill-run --version and distill-teacher --version print it.
  m.attr("__version__") = distill::version();
}
