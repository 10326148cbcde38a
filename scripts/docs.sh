#!/usr/bin/env bash
# The generated API references, into build/docs/ (never committed; CI's docs step, .ci/run lane b):
#
#   bash scripts/docs.sh                  C++: Doxygen over the stable headers (docs/reference/api.md),
#                                         failing on any warning (an undocumented public symbol is one)
#   PYTHON=.venv/bin/python bash scripts/docs.sh
#                                         also the Python package installed in that interpreter: its
#                                         py.typed and _kvscore.pyi stub checked, pdoc's HTML built
#
# KVSCORE_DOCS_OUT picks the folder (default build/docs). Warnings in the headers listed in
# scripts/doxygen/pending.txt are printed and counted but do not fail (their branches document them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${KVSCORE_DOCS_OUT:-build/docs}
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
command -v doxygen >/dev/null || { echo "scripts/docs.sh: doxygen missing (bash scripts/deps.sh python ci)" >&2; exit 2; }
VERSION=$(sed -n 's/^#define KVSCORE_VERSION_STRING "\([^"]*\)".*/\1/p' include/kvscore/version.hpp)

t0=$(date +%s)
rm -rf "$OUT/cpp" && mkdir -p "$OUT/cpp"
{ cat scripts/doxygen/Doxyfile
  echo "PROJECT_NUMBER = $VERSION"
  echo "OUTPUT_DIRECTORY = $OUT/cpp"
  echo "WARN_LOGFILE = $OUT/cpp/warnings.log"; } | doxygen - >/dev/null
pending=$(grep -v '^#' scripts/doxygen/pending.txt | sed '/^$/d' || true)
fatal=0 tolerated=0
while IFS= read -r line; do
  [ -n "$line" ] || continue
  file=${line%%:*}; file=${file#"$ROOT"/}
  is_pending=0
  for p in $pending; do case "$file" in "$p"*) is_pending=1 ;; esac; done
  if [ "$is_pending" = 1 ]; then tolerated=$((tolerated + 1)); else fatal=$((fatal + 1)); echo "doxygen: $line"; fi
done < <(grep -E '^[^ ].*(warning|error):' "$OUT/cpp/warnings.log" || true)
for p in $pending; do
  if [ -e "$p" ] && ! grep -q "^$ROOT/$p" "$OUT/cpp/warnings.log"; then
    echo "doxygen: $p (scripts/doxygen/pending.txt) has no warning left: take it off the list"
  fi
done
echo "doxygen: $fatal warnings in the stable headers, $tolerated in the pending ones (scripts/doxygen/pending.txt); HTML: $OUT/cpp/html/index.html ($(($(date +%s) - t0)) s)"
[ "$fatal" = 0 ] || exit 1

[ -n "${PYTHON:-}" ] || exit 0
t0=$(date +%s)
# the installed package, not python/kvscore: run outside the tree
PKG=$(cd /tmp && "$PYTHON" -c "import kvscore, os; print(os.path.dirname(kvscore.__file__))")
[ -f "$PKG/py.typed" ] || { echo "python: $PKG has no py.typed"; exit 1; }
[ -f "$PKG/_kvscore.pyi" ] || { echo "python: $PKG has no _kvscore.pyi (the wheel's stub, nanobind_add_stub)"; exit 1; }
(cd /tmp && "$PYTHON" - "$PKG/_kvscore.pyi" <<'PY'
import ast, sys
import kvscore._kvscore as k
tree = ast.parse(open(sys.argv[1]).read())
names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
names |= {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
          for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
missing = sorted(x for x in dir(k) if not x.startswith("_") and x not in names)
if missing:
    sys.exit(f"python: _kvscore.pyi lacks {len(missing)} names of the module: {missing[:10]}")
print(f"python: _kvscore.pyi covers the module's {len(names)} public names")
PY
)
rm -rf "$OUT/python"
# kvscore.vllm imports vLLM, which only .venv-vllm has: its page is the guide (docs/guides/vllm.md)
(cd /tmp && "$PYTHON" -m pdoc --docformat markdown -o "$OUT/python" kvscore kvscore.presses kvscore.generation \
  kvscore.quality 2>&1) | sed 's/^/pdoc: /'
for m in kvscore kvscore/presses kvscore/generation kvscore/quality; do
  [ -f "$OUT/python/$m.html" ] || { echo "python: pdoc wrote no $m.html"; exit 1; }
done
echo "python: pdoc HTML $OUT/python/kvscore.html ($(($(date +%s) - t0)) s)"
