#!/usr/bin/env python
"""Synthetic output perturbation of every registered kvcompress method (model-free).

    python benchmarks/synthetic_perturbation.py            # default sweep, ~1 min on 2 cores
    python benchmarks/synthetic_perturbation.py --quick    # seconds
    python benchmarks/synthetic_perturbation.py --seq-lens 1024 --budgets 64 128 --seeds 0 1

Writes <out>/synthetic.json and synthetic.png and prints the table; the same as
``kvcompress bench synthetic``. See docs/benchmarks.md and kvcompress/bench/synthetic.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcompress._blas import reexec_with_openblas

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from kvcompress.bench import synthetic

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    synthetic.add_arguments(ap)
    ap.set_defaults(out=str(REPO / "docs" / "results"))
    synthetic.run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    reexec_with_openblas([__file__, *sys.argv[1:]])
    sys.exit(main())
