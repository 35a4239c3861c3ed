#pragma once

// The Python-side Session: distill::Session, shared by the objects made from
// it (Client views, Steps) so that it outlives them whatever Python frees first.

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "distill/student/init.h"

namespace distill::py {

struct PySession {
  Session session;
  std::vector<std::string> argv; // what init() left of the arguments

  Client& client() const;
  StudentContext& student() const;
};

using SessionPtr = std::shared_ptr<PySession>;

} // namespace distill::py
