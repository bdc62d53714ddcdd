#!/usr/bin/env bash
# Set up attnkit in ./.venv from nothing but Python 3.11; safe to run again (skips what is there).
#   scripts/setup.sh          library + CLI
#   scripts/setup.sh --test   also the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: the CPU wheel 2.13.0. A looser requirement can pull a CUDA build.
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || pip install torch==2.13.0
extra="[all]"
[ "${1:-}" = "--test" ] && extra="[all,test]"
stamp=".venv/.attnkit-installed${extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  pip install -e ".${extra}"
  touch "$stamp"
fi
# The C++ CPU operators, built now (about a minute, once) rather than at the first call that needs them.
.venv/bin/python -c "import sys; from attnkit.kernels.cpu.build import main; sys.exit(main())" || echo "attnkit: continuing without the C++ operators (the PyTorch tiles run instead)"
# The report tests open pages in headless Chromium: Debian's package, installed once.
if [ "${1:-}" = "--test" ] && ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi
