#!/usr/bin/env bash
# The test suite, as CI runs it (after `scripts/setup.sh --test`):
# 1. the kernel, property and mechanism tests once more under the other CPU setting this
#    host can reach, since results can depend on the CPU: on an AVX-512 host, torch's
#    kernels and inductor's generated code at AVX2 (ATEN_CPU_CAPABILITY=avx2) with the C++
#    operators built for x86-64-v3 (AVX2) instead of -march=native; on an AVX2 host,
#    torch's unvectorised kernels (default) with the operators built for x86-64-v2 (no AVX);
# 2. the whole suite on this host's own setting (its closing line is the suite's count).
# Before them: ruff (lint and format check) and mypy, as configured in pyproject.toml, and
# the C++ operators' boundary and value tests under AddressSanitizer (scripts/asan.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
capability=$($PY -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
case "$capability" in
  AVX512*) other=avx2; arch=x86-64-v3 ;;
  *) other=default; arch=x86-64-v2 ;;
esac
echo "== ruff (lint and format) and mypy"
$PY -m ruff check src tests && $PY -m ruff format --check src tests && $PY -m mypy
lint=$?
echo "== the C++ operators under AddressSanitizer (scripts/asan.sh)"
scripts/asan.sh -q
asan=$?
echo "== kernels, properties, mechanisms at ATEN_CPU_CAPABILITY=$other, C++ operators -march=$arch (this host: $capability)"
ATEN_CPU_CAPABILITY=$other ATTNKIT_MARCH=$arch ATTNKIT_PROPERTY_SCALE=${ATTNKIT_PROPERTY_SCALE:-0.5} \
  $PY -m pytest -q -p no:cacheprovider tests/kernels tests/properties tests/mechanisms
first=$?
echo "== the whole suite at this host's setting ($capability)"
$PY -m pytest -q
rc=$?
# pytest exits 5 when it collects no test: that is a failure of the suite, not a pass.
[ $rc -eq 5 ] && echo "pytest collected no tests" && exit 1
[ $lint -ne 0 ] && echo "ruff or mypy failed (exit $lint)" && exit $lint
[ $asan -ne 0 ] && echo "the AddressSanitizer run failed (exit $asan)" && exit $asan
[ $first -ne 0 ] && echo "the tests at ATEN_CPU_CAPABILITY=$other failed (exit $first)" && exit $first
exit $rc
