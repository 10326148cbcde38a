// kvscore/dtype.hpp — moved to kvscore/core/dtype.hpp (the ground floor, docs/architecture.md);
// this path stays so that existing includes keep working.
#pragma once

#include "kvscore/core/dtype.hpp"
