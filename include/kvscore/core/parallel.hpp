// kvscore/core/parallel.hpp — the library's one parallel loop over heads (or any index).
//
// f(i) for every i in [0, n), static schedule over OpenMP threads. No exception ever crosses
// the OpenMP region (that would call std::terminate): an exception thrown by f is caught in
// its thread, every other index still runs, and after the region the exception of the
// *lowest* failing index is rethrown, so the error reported does not depend on the thread
// count (a serial run stops at that same index).
#pragma once

#include <cstdint>
#include <exception>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvscore::detail {

/// Threads a `num_threads` option asks for: 0 = OpenMP's default, else the value.
inline int resolve_threads(int num_threads) noexcept {
#if defined(_OPENMP)
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

/// f(i, tid) for every i in [0, n) on `threads` threads (a count, >= 1; tid < threads), each
/// thread's `setup(tid)` run once before its first index. The core of the loops below.
template <class Setup, class F>
void parallel_for_tid(std::int64_t n, int threads, Setup&& setup, F&& f) {
#if defined(_OPENMP)
  if (threads > 1 && n > 1) {
    std::exception_ptr err;
    std::int64_t err_at = n;
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num();
      auto state = setup(tid);
#pragma omp for schedule(static)
      for (std::int64_t i = 0; i < n; ++i) {
        try {
          f(state, i, tid);
        } catch (...) {
#pragma omp critical(kvscore_parallel_for)
          if (i < err_at) {
            err_at = i;
            err = std::current_exception();
          }
        }
      }
    }
    if (err) std::rethrow_exception(err);
    return;
  }
#endif
  (void)threads;
  auto state = setup(0);
  for (std::int64_t i = 0; i < n; ++i) f(state, i, 0);
}

/// f(state, i) for every i in [0, n) on `num_threads` threads (0 = OpenMP default, 1 = serial);
/// each thread default-constructs one State and reuses it (scratch buffers).
template <class State, class F>
void parallel_for_state(std::int64_t n, int num_threads, F&& f) {
  parallel_for_tid(
      n, resolve_threads(num_threads), [](int) { return State{}; },
      [&](State& s, std::int64_t i, int) { f(s, i); });
}

/// f(i) for every i in [0, n) on `num_threads` threads (0 = OpenMP default, 1 = serial).
template <class F>
void parallel_for(std::int64_t n, int num_threads, F&& f) {
  parallel_for_tid(
      n, resolve_threads(num_threads), [](int) { return 0; }, [&](int, std::int64_t i, int) { f(i); });
}

}  // namespace kvscore::detail
