// kvscore/selection.hpp — moved to kvscore/core/selection.hpp (the ground floor, docs/architecture.md);
// this path stays so that existing includes keep working.
#pragma once

#include "kvscore/core/selection.hpp"
