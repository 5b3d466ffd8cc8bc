#!/usr/bin/env python
"""Decode tokens/s and prefill time of kvcompress caches vs mlx-lm's RotatingKVCache.

    python benchmarks/speed.py            # default: 4096-token context, budget 512, ~7-10 min
    python benchmarks/speed.py --quick    # tiny model, seconds
    python benchmarks/speed.py --rounds 5 --dtype bfloat16 --prefill-step-size 2048

Writes speed.json and speed.png and prints the ratio table and the decode profile: the same as
``kvcompress bench speed``, which this script runs. Output folder: ``--out DIR``, by default
``./kvcompress-results``; ``--out docs/results`` refreshes the committed results. See
docs/benchmarks.md and kvcompress/bench/speed.py.
"""

import sys

from kvcompress.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "speed", *sys.argv[1:]]))
