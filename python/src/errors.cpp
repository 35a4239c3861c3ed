// distill's C++ errors as Python exceptions of the same names and messages:
// one class per entry of DISTILL_ERROR_TYPES (core/include/distill/core/errors.h).
#include "bindings.h"

#include <torch/csrc/Exceptions.h>

#include <cstring>
#include <string>

#include "distill/core/errors.h"

namespace distill::py {

namespace {

// The Python classes, made once at import (kept for the life of the process):
// the base, then one per DISTILL_ERROR_TYPES entry, in the list's order.
#define DISTILL_PY_ERROR_COUNT(Name) +1
constexpr int kErrorTypes = 0 DISTILL_ERROR_TYPES(DISTILL_PY_ERROR_COUNT);
#undef DISTILL_PY_ERROR_COUNT
PyObject* gBase = nullptr;
PyObject* gClasses[kErrorTypes] = {};

PyObject* makeClass(pyb::module_& m, const char* name, PyObject* base) {
  auto cls = pyb::exception<Error>(m, name, base);
  PyObject* p = cls.ptr();
  Py_INCREF(p);
  return p;
}

// The Python class of `e`'s most derived distill type.
PyObject* classOf(const Error& e) {
  int k = 0;
#define DISTILL_PY_ERROR_CLASS(Name)                     \
  if (dynamic_cast<const Name*>(&e)) return gClasses[k]; \
  ++k;
  DISTILL_ERROR_TYPES(DISTILL_PY_ERROR_CLASS)
#undef DISTILL_PY_ERROR_CLASS
  return gBase;
}

// The message a Python user reads: the C++ message, identity, step and what
// was awaited, whole; not the C++ source location what() ends with.
std::string pythonMessage(const Error& e) {
  std::string what = e.what();
  const char* base = std::strrchr(e.file(), '/');
  const std::string location = std::string(" (") + (base ? base + 1 : e.file()) + ":" + std::to_string(e.line()) + ")";
  if (what.size() >= location.size() && what.compare(what.size() - location.size(), location.size(), location) == 0)
    what.erase(what.size() - location.size());
  return what;
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    PyErr_SetString(classOf(e), pythonMessage(e).c_str());
  } catch (const c10::Error&) {
    // torch's own translation: its Python classes, the message without the C++ backtrace.
    torch::translate_exception_to_python(std::current_exception());
  }
}

} // namespace

void bindErrors(pyb::module_& m) {
  gBase = makeClass(m, "Error", PyExc_RuntimeError);
  pyb::list names;
  int k = 0;
  // TimeoutError is also Python's own (an OSError): `except TimeoutError` catches distill's.
  const pyb::tuple timeoutBases = pyb::make_tuple(pyb::handle(gBase), pyb::handle(PyExc_TimeoutError));
#define DISTILL_PY_ERROR_BIND(Name)                                                                  \
  gClasses[k++] = makeClass(m, #Name, std::strcmp(#Name, "TimeoutError") == 0 ? timeoutBases.ptr() : gBase); \
  names.append(#Name);
  DISTILL_ERROR_TYPES(DISTILL_PY_ERROR_BIND)
#undef DISTILL_PY_ERROR_BIND
  // The list's names, for the test that distill exports each.
  m.attr("_error_types") = pyb::tuple(names);
  pyb::register_exception_translator(&translate);
}

} // namespace distill::py
