#!/usr/bin/env bash
# llama.cpp for examples/llama_cpp (docs/guides/integration.md): the source vendored in the PyPI sdist
# llama-cpp-python 0.3.36 (vendor/llama.cpp; archive hash checked), built CPU-only as static
# libraries -- only the `llama` library and the ggml libraries it links, no tests, tools, examples,
# server, common or curl -- and installed into a prefix that kvscore's CMake takes as
# -DKVSCORE_LLAMA_CPP=<prefix>. Idempotent: a finished build with the same archive and options is
# not redone. Prints the prefix on stdout (everything else goes to stderr).
#   bash scripts/llama_cpp.sh [fetch|build]     (default: build, which fetches first if needed)
# LLAMA_CPP_DIR     working folder (default build-llama/): archive, source, build tree, prefix
# LLAMA_CPP_SDIST   an already downloaded llama_cpp_python-0.3.36.tar.gz to use (hash checked)
# PYTHON            the interpreter whose pip downloads the sdist (default python3)
# LLAMA_CPP_OPT     optimisation level (default -O2, as kvscore's own build and every timing in
#                   docs/guides/integration.md; scripts/test.sh asks -O1: its tests check tokens, not speed,
#                   and the build takes 120 instead of 164 s of CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=${1:-build}
VERSION=0.3.36
ARCHIVE=llama_cpp_python-$VERSION.tar.gz
SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
DIR=${LLAMA_CPP_DIR:-build-llama}
case "$DIR" in /*) ;; *) DIR="$ROOT/$DIR" ;; esac
SRC=$DIR/llama.cpp
PREFIX=$DIR/prefix
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DIR"

fetch() {
  if [ ! -f "$SRC/.extracted-$SHA" ]; then
    if [ ! -s "$DIR/$ARCHIVE" ]; then
      if [ -n "${LLAMA_CPP_SDIST:-}" ]; then
        cp "$LLAMA_CPP_SDIST" "$DIR/$ARCHIVE.part"
        mv "$DIR/$ARCHIVE.part" "$DIR/$ARCHIVE"
      else
        # pip, the registry's own client; --no-binary: the sdist (the wheel has no C++ source)
        "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" >&2
      fi
    fi
    if ! echo "$SHA  $DIR/$ARCHIVE" | sha256sum -c --quiet - >&2; then
      echo "llama_cpp.sh: $DIR/$ARCHIVE does not have the pinned sha256 $SHA; removed" >&2
      rm -f "$DIR/$ARCHIVE"
      exit 1
    fi
    rm -rf "$SRC" "$SRC.part"
    mkdir -p "$SRC.part"
    # only the vendored llama.cpp (~3700 of the archive's ~3900 files; the rest is the Python package)
    tar -xzf "$DIR/$ARCHIVE" -C "$SRC.part" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    touch "$SRC.part/.extracted-$SHA"
    mv "$SRC.part" "$SRC"
  fi
}

build() {
  # -O2 as kvscore's own build unless LLAMA_CPP_OPT; GGML_NATIVE=OFF: the x86-64 build then targets
  # AVX2/FMA/F16C (ggml's defaults without -march=native), so the binary runs on any AVX2 machine.
  local opt=${LLAMA_CPP_OPT:--O2}
  case "$opt" in -O0 | -O1 | -O2 | -O3 | -Os) ;; *) echo "llama_cpp.sh: LLAMA_CPP_OPT must be -O0..-O3 or -Os (got '$opt')" >&2; exit 2 ;; esac
  local opts=(
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS_RELEASE=$opt -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELEASE=$opt -DNDEBUG"
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=ON
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
    "-DCMAKE_INSTALL_PREFIX=$PREFIX" -DCMAKE_INSTALL_LIBDIR=lib
  )
  local stamp
  stamp=$(printf '%s\n' "$SHA" "${opts[@]}" "$(c++ --version | sed -n 1p)" | sha256sum | cut -c1-16)
  if [ -f "$PREFIX/.built-$stamp" ] && [ -f "$PREFIX/lib/cmake/llama/llama-config.cmake" ]; then
    echo "$PREFIX"
    return
  fi
  fetch
  local launcher=()
  if command -v ccache >/dev/null 2>&1; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  local t0 t1 t2
  t0=$(date +%s)
  cmake -S "$SRC" -B "$DIR/build" "${opts[@]}" "${launcher[@]}" >"$DIR/configure.log" 2>&1 ||
    { cat "$DIR/configure.log" >&2; exit 1; }
  t1=$(date +%s)
  # With tests, tools, examples and common off, `all` is `llama` and the ggml libraries it links.
  cmake --build "$DIR/build" -j"$JOBS" --target llama >&2
  rm -rf "$PREFIX"
  cmake --install "$DIR/build" >/dev/null
  t2=$(date +%s)
  touch "$PREFIX/.built-$stamp"
  echo "llama.cpp $VERSION (vendored): configure $((t1 - t0)) s, build + install $((t2 - t1)) s -> $PREFIX" >&2
  echo "$PREFIX"
}

case "$MODE" in
  fetch) fetch ;;
  build) build ;;
  *) echo "usage: bash scripts/llama_cpp.sh [fetch|build]" >&2; exit 2 ;;
esac
