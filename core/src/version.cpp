#include "distill/core/version.h"

#include "distill/build_config.h"

namespace distill {

const char* version() { return DISTILL_VERSION; }

} // namespace distill
