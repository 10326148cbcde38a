// kvscore/version.hpp
#pragma once

#define KVSCORE_VERSION_MAJOR 0
#define KVSCORE_VERSION_MINOR 1
#define KVSCORE_VERSION_PATCH 0

namespace kvscore {
inline constexpr const char* version_string = "0.1.0";
}  // namespace kvscore
