#!/usr/bin/env python
"""Speed and memory of every kvcompress method against context length, at several budgets.

    python benchmarks/scaling.py            # default: contexts 1k-8k, budgets 256/512/1024, ~40 min
    python benchmarks/scaling.py --quick    # tiny model, seconds
    python benchmarks/scaling.py --methods h2o,cam --budgets 512 --contexts 2048,4096

Writes scaling.json and scaling.png and prints the ratio table: the same as
``kvcompress bench scaling``, which this script runs. Output folder: ``--out DIR``, by default
``./kvcompress-results``; ``--out docs/results`` refreshes the committed results. See
docs/benchmarks.md and kvcompress/bench/scaling.py.
"""

import sys

from kvcompress.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "scaling", *sys.argv[1:]]))
