#!/usr/bin/env python
"""Decode tokens/s and prefill time of kvcompress caches vs mlx-lm's RotatingKVCache.

    python benchmarks/speed.py            # default: 4096-token context, budget 512, ~7-10 min
    python benchmarks/speed.py --quick    # tiny model, seconds
    python benchmarks/speed.py --rounds 5 --dtype bfloat16 --prefill-step-size 2048

Writes <out>/speed.json and speed.png and prints the ratio table and the decode profile; the
same as ``kvcompress bench speed``. See docs/benchmarks.md and kvcompress/bench/speed.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress._blas import reexec_with_openblas

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from kvcompress.bench import speed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    speed.add_arguments(ap)
    ap.set_defaults(out=str(REPO / "docs" / "results"))
    speed.run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    reexec_with_openblas([__file__, *sys.argv[1:]])
    sys.exit(main())
