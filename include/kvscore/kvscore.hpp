// kvscore/kvscore.hpp — umbrella header.
#pragma once

#include "kvscore/dtype.hpp"
#include "kvscore/npy.hpp"
#include "kvscore/scorers/keydiff.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/scorers/manifold_l2.hpp"
#include "kvscore/scorers/qfilter.hpp"
#include "kvscore/scorers/scorer_base.hpp"
#include "kvscore/scorers/windowed_manifold_l2.hpp"
#include "kvscore/simd/dispatch.hpp"
#include "kvscore/simd/kernels.hpp"
#include "kvscore/simd/table.hpp"
#include "kvscore/version.hpp"
#include "kvscore/view.hpp"
