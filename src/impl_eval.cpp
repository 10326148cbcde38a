// The evaluator's non-template functions, compiled once (kvscore/detail/compiled.hpp): users
// of kvscore::dispatch see only their declarations.
#include "kvscore/impl/eval_evaluate_impl.hpp"
#include "kvscore/impl/eval_methods_impl.hpp"
#include "kvscore/impl/eval_metrics_impl.hpp"
