"""Serving benchmark, the same as `brisk bench serve` (see `python benchmarks/serve.py --help`)."""

import sys

from brisk.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
