"""Benchmark suites of ``attnkit bench`` as a script, one suite or all:

    python benchmarks/run.py [SUITE ...] [--quick] [--json out.json]

SUITE is one of ``attnkit.bench.SUITES`` (kernels, hf, inspect, linear, sparse, mechanisms, probes).
"""

import sys

from attnkit.bench import SUITES
from attnkit.cli import main

if __name__ == "__main__":
    suites = [a for a in sys.argv[1:] if a in SUITES]
    flags = [a for a in sys.argv[1:] if a not in SUITES]
    sys.exit(main(["bench", *(f"--suite={s}" for s in suites), *flags]))
