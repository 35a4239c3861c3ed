// distill's C++ errors as Python exceptions of the same names and messages.
#include "bindings.h"

#include <torch/csrc/Exceptions.h>

#include <cstring>
#include <string>

#include "distill/core/errors.h"

namespace distill::py {

namespace {

// The Python classes, made once at import (kept for the life of the process).
struct Classes {
  PyObject *base, *config, *ipc, *timeout, *peerLost, *protocol, *checkpoint, *internal;
};
Classes gClasses{};

PyObject* makeClass(pyb::module_& m, const char* name, PyObject* base) {
  auto cls = pyb::exception<Error>(m, name, base);
  PyObject* p = cls.ptr();
  Py_INCREF(p);
  return p;
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
  } catch (const ConfigError& e) {
    PyErr_SetString(gClasses.config, pythonMessage(e).c_str());
  } catch (const IpcError& e) {
    PyErr_SetString(gClasses.ipc, pythonMessage(e).c_str());
  } catch (const TimeoutError& e) {
    PyErr_SetString(gClasses.timeout, pythonMessage(e).c_str());
  } catch (const PeerLostError& e) {
    PyErr_SetString(gClasses.peerLost, pythonMessage(e).c_str());
  } catch (const ProtocolError& e) {
    PyErr_SetString(gClasses.protocol, pythonMessage(e).c_str());
  } catch (const CheckpointError& e) {
    PyErr_SetString(gClasses.checkpoint, pythonMessage(e).c_str());
  } catch (const InternalError& e) {
    PyErr_SetString(gClasses.internal, pythonMessage(e).c_str());
  } catch (const Error& e) {
    PyErr_SetString(gClasses.base, pythonMessage(e).c_str());
  } catch (const c10::Error&) {
    // torch's own translation: its Python classes, the message without the C++ backtrace.
    torch::translate_exception_to_python(std::current_exception());
  }
}

} // namespace

void bindErrors(pyb::module_& m) {
  gClasses.base = makeClass(m, "Error", PyExc_RuntimeError);
  gClasses.config = makeClass(m, "ConfigError", gClasses.base);
  gClasses.ipc = makeClass(m, "IpcError", gClasses.base);
  // Also Python's own TimeoutError (an OSError): `except TimeoutError` catches distill's.
  const pyb::tuple timeoutBases = pyb::make_tuple(pyb::handle(gClasses.base), pyb::handle(PyExc_TimeoutError));
  gClasses.timeout = makeClass(m, "TimeoutError", timeoutBases.ptr());
  gClasses.peerLost = makeClass(m, "PeerLostError", gClasses.base);
  gClasses.protocol = makeClass(m, "ProtocolError", gClasses.base);
  gClasses.checkpoint = makeClass(m, "CheckpointError", gClasses.base);
  gClasses.internal = makeClass(m, "InternalError", gClasses.base);
  pyb::register_exception_translator(&translate);
}

} // namespace distill::py
