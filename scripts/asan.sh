#!/usr/bin/env bash
# The C++ operators (src/attnkit/kernels/cpu) under AddressSanitizer: a build with
# -fsanitize=address (ATTNKIT_SANITIZE=address, an extension of its own name beside the
# normal one), then the operators' boundary tests (every torch.ops.attnkit.* with bad
# shapes, dtypes and values, each in a child process that inherits the sanitizer) and
# their value tests, with the sanitizer's runtime preloaded into Python. Any
# out-of-bounds access, use after free or double free aborts the process that made it,
# which fails its test. Leaks are not checked (Python and torch keep memory to the end).
#
#   scripts/asan.sh            # build if needed, run the tests
#   scripts/asan.sh -x -k nsa  # extra arguments go to pytest
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CXX=${CXX:-c++}
runtime=$($CXX -print-file-name=libasan.so)
if [ ! -e "$runtime" ] || [ "$runtime" = "libasan.so" ]; then
  echo "asan.sh: $CXX has no libasan.so (install the compiler's AddressSanitizer runtime)" >&2
  exit 2
fi
# libstdc++ preloaded right after the runtime: Python does not link it, and without it the
# runtime's __cxa_throw interceptor finds no real __cxa_throw, so the first C++ exception
# (every TORCH_CHECK that fails) aborts the process.
runtime="$runtime $($CXX -print-file-name=libstdc++.so.6)"
export ATTNKIT_SANITIZE=address
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=0}
start=$(date +%s)

# 1. Build (the compiler runs with the runtime preloaded too, harmlessly: it is not
#    instrumented) and load once.
echo "== building the operators with -fsanitize=address"
LD_PRELOAD="$runtime" $PY - <<'EOF'
from attnkit.kernels.cpu import build
print("asan.sh: build step:", build.status().describe())
EOF
built=$(date +%s)

# 2. The tests, with the runtime first in the process (children inherit it).
echo "== operator tests under AddressSanitizer"
LD_PRELOAD="$runtime" $PY - <<'EOF'
import sys
from attnkit.kernels.cpu import build
st = build.status()
print("asan.sh:", st.describe())
sys.exit(0 if st.available and "sanitize=address" in st.reason else 1)
EOF
loaded=$?
if [ $loaded -ne 0 ]; then
  echo "asan.sh: the sanitized operators did not load; nothing was checked" >&2
  exit 1
fi
LD_PRELOAD="$runtime" $PY -m pytest -q -p no:cacheprovider \
  tests/kernels/test_operator_boundary.py tests/kernels/test_cpu_ops.py tests/kv/test_native_step.py \
  tests/mechanisms/test_native_sparse.py "$@"
rc=$?
end=$(date +%s)
echo "asan.sh: build $((built - start)) s, tests $((end - built)) s, exit $rc"
exit $rc
