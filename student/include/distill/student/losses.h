#pragma once

// The losses live in their own module, loss/ (distill::loss): this header
// keeps the old include path working for existing trainers.
#include "distill/loss/losses.h"
