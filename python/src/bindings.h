#pragma once

// distill._C, the Python binding (docs/python.md, "Python trainers"). Each bind*
// function adds one part of the C++ API to the module; the classes wrap the C++
// objects of the same names, so there is one engine for both languages. What
// only Python can do (torch.save of state dicts, DDP, signal handlers, the
// student world of torch.distributed) lives in the package, python/distill.
//
// The GIL: every call that may wait on another process (init, submit, get,
// Steps.next/backward, serve) releases it; Python callables called from C++
// (a loader, a teacher's forward, checkpoint callbacks) take it back.

#include <torch/extension.h>

namespace distill::py {

namespace pyb = pybind11;

void bindErrors(pyb::module_& m);
void bindSession(pyb::module_& m);
void bindClient(pyb::module_& m);
void bindSteps(pyb::module_& m);
void bindTeacher(pyb::module_& m);
void bindExit(pyb::module_& m);

} // namespace distill::py
