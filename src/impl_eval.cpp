// The evaluator's non-template functions, compiled once (kvscore/detail/compiled.hpp): users
// of kvscore::dispatch see only their declarations.
#include "kvscore/eval/evaluate_impl.hpp"
#include "kvscore/eval/methods_impl.hpp"
#include "kvscore/eval/metrics_impl.hpp"
