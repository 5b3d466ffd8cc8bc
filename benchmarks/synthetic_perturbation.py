#!/usr/bin/env python
"""Synthetic output perturbation of every registered kvcompress method (model-free).

    python benchmarks/synthetic_perturbation.py            # default sweep, ~1 min on 2 cores
    python benchmarks/synthetic_perturbation.py --quick    # seconds
    python benchmarks/synthetic_perturbation.py --seq-lens 1024 --budgets 64 128 --seeds 0 1

Writes synthetic.json and synthetic.png and prints the table: the same as
``kvcompress bench synthetic``, which this script runs. Output folder: ``--out DIR``, by default
``./kvcompress-results``; ``--out docs/results`` refreshes the committed results. See
docs/benchmarks.md and kvcompress/bench/synthetic.py.
"""

import sys

from kvcompress.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "synthetic", *sys.argv[1:]]))
