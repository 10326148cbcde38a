// kvscore/version.hpp — the one version of kvscore. CMake's project version (CMakeLists.txt reads
// the three numbers below), the Python package's (pyproject.toml reads KVSCORE_VERSION_STRING),
// `kvscore --version` and `kvscore.__version__` all come from here; tests/test_tree.cpp and
// python/tests/test_tree.py check that they agree, with CHANGELOG.md's latest release too.
// Compatibility (docs/reference/api.md#versions): in 0.x a minor release may change the API, a
// patch release does not.
#pragma once

#define KVSCORE_VERSION_MAJOR 0  ///< major version
#define KVSCORE_VERSION_MINOR 2  ///< minor version: in 0.x, may change the API
#define KVSCORE_VERSION_PATCH 0  ///< patch version: fixes only
#define KVSCORE_VERSION_STRING "0.2.0"  ///< "MAJOR.MINOR.PATCH"

namespace kvscore {
/// The library version, "MAJOR.MINOR.PATCH" (KVSCORE_VERSION_STRING).
inline constexpr const char* version_string = KVSCORE_VERSION_STRING;
}  // namespace kvscore
