// distill's C++ errors as Python exceptions of the same names and messages.
#include "bindings.h"

#include "distill/core/errors.h"

namespace distill::py {

void bindErrors(pyb::module_& m) {
  // The most derived class is tried first (pybind11 tries translators in
  // reverse order of registration), so the base goes first.
  auto base = pyb::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  pyb::register_exception<ConfigError>(m, "ConfigError", base.ptr());
  pyb::register_exception<IpcError>(m, "IpcError", base.ptr());
  pyb::register_exception<TimeoutError>(m, "TimeoutError", base.ptr());
  pyb::register_exception<PeerLostError>(m, "PeerLostError", base.ptr());
  pyb::register_exception<ProtocolError>(m, "ProtocolError", base.ptr());
  pyb::register_exception<CheckpointError>(m, "CheckpointError", base.ptr());
  pyb::register_exception<InternalError>(m, "InternalError", base.ptr());
}

} // namespace distill::py
