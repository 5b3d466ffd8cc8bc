#!/usr/bin/env python
"""Speed and memory of every kvcompress method against context length, at several budgets.

    python benchmarks/scaling.py            # default: contexts 1k-8k, budgets 256/512/1024, ~40 min
    python benchmarks/scaling.py --quick    # tiny model, seconds
    python benchmarks/scaling.py --methods h2o,cam --budgets 512 --contexts 2048,4096

Writes <out>/scaling.json and scaling.png and prints the ratio table; the same as
``kvcompress bench scaling``. See docs/benchmarks.md and kvcompress/bench/scaling.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress._blas import reexec_with_openblas

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from kvcompress.bench import scaling

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scaling.add_arguments(ap)
    ap.set_defaults(out=str(REPO / "docs" / "results"))
    scaling.run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    reexec_with_openblas([__file__, *sys.argv[1:]])
    sys.exit(main())
