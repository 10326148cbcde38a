#!/usr/bin/env bash
# Builds and runs every libFuzzer harness for a bounded time (see scripts/fuzz.sh for the knobs).
exec "$(dirname "$0")/../scripts/fuzz.sh" "$@"
