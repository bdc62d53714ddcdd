"""Kernel benchmarks (the foundation issue's table): python benchmarks/kernels.py [--quick] [--json out.json]"""

import sys

from attnkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--suite", "kernels", *sys.argv[1:]]))
