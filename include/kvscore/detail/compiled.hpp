// kvscore/detail/compiled.hpp — where the library's heavy non-template functions are defined.
//
// A few functions are plain (non-template) code that instantiates large Eigen templates
// (an SVD, QR, GEMMs): g++ instantiates those in *every* translation unit that includes the
// header, used or not — an SVD alone costs ~10-30 s of compile time per TU. Their definitions
// live in an _impl.hpp beside their header (eval/methods_impl.hpp, ojakv/ojakv_impl.hpp, ...):
//   - header-only use (no KVSCORE_COMPILED): the public header includes its _impl.hpp and
//     the functions are `inline`, as before;
//   - linking kvscore::dispatch (which defines KVSCORE_COMPILED=1 for its users): the public
//     header only declares them, and src/impl_*.cpp compile the definitions once.
// Every translation unit of one program must agree: either all see KVSCORE_COMPILED (link
// kvscore::dispatch) or none does.
#pragma once

#if defined(KVSCORE_COMPILED)
#define KVSCORE_IMPL_INLINE
#else
#define KVSCORE_IMPL_INLINE inline
#endif
