// kvscore/view.hpp — moved to kvscore/core/view.hpp (the ground floor, docs/architecture.md);
// this path stays so that existing includes keep working.
#pragma once

#include "kvscore/core/view.hpp"
