"""tools/fixtures.py — the command line every tools/gen_*.py fixture generator shares.

A generator builds its fixture set in memory, {relative path: bytes}, and passes it here:
without arguments the files are written under the set's directory (tests/data/<set>/), with
--check they are compared with the files on disk byte for byte and nothing is written (exit 1
and the differing paths when one differs or is missing).
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Callable

import numpy as np


def npy_bytes(a: np.ndarray) -> bytes:
    """The bytes np.save writes for `a` (no pickles)."""
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def main(doc: str, out_dir: str, build: Callable[[], dict[str, bytes]], *,
         self_check: Callable[[], None] | None = None, max_bytes: int | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out_dir, help=f"output directory (default: {os.path.relpath(out_dir)})")
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = ap.parse_args()

    if self_check is not None:
        self_check()
    files = build()
    total = sum(len(v) for v in files.values())
    if max_bytes is not None:
        assert total < max_bytes, f"fixtures too large: {total} bytes"

    if args.check:
        bad = [rel for rel, data in sorted(files.items())
               if not os.path.exists(os.path.join(args.out, rel))
               or open(os.path.join(args.out, rel), "rb").read() != data]
        if bad:
            print("out of date:", *bad, sep="\n  ", file=sys.stderr)
            return 1
        print(f"{len(files)} fixture files up to date ({total} bytes)")
        return 0

    for rel, data in sorted(files.items()):
        p = os.path.join(args.out, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(data)
    print(f"wrote {len(files)} files ({total} bytes) to {args.out}")
    return 0
