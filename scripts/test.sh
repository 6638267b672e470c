#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs every test: the C++ suite through ctest
# (GoogleTest, the installed-package check, a bounded libFuzzer run) and the
# Python suite through pytest. Exits non-zero on any failure.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh -k config       # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

scripts/setup.sh

echo "== C++ tests (ctest) =="
ctest --test-dir build --output-on-failure -j "$(nproc)"

echo "== C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer =="
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=address,undefined \
  -DTANDEM_CUDA=OFF -DTANDEM_PYTHON=OFF -DTANDEM_BENCH=OFF >/dev/null
cmake --build build-asan -j "$(nproc)" --target tandem_tests
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 build-asan/tests/tandem_tests --gtest_brief=1

echo "== pool, engine and trace tests under ThreadSanitizer =="
# Only these: libgomp is not TSan-instrumented, so tests whose packing runs OpenMP
# teams would report its internal synchronization; pool threads run OpenMP with one
# thread (no team), and that is what these tests exercise.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=thread \
  -DTANDEM_CUDA=OFF -DTANDEM_PYTHON=OFF -DTANDEM_BENCH=OFF >/dev/null
cmake --build build-tsan -j "$(nproc)" --target tandem_tests
OMP_NUM_THREADS=1 TSAN_OPTIONS=halt_on_error=1 build-tsan/tests/tandem_tests --gtest_brief=1 \
  --gtest_filter='Pool.*:*MoeEngine*:Trace.*:*Hybrid*:Engine.*:Lora*'

echo "== Python tests (pytest) =="
.venv/bin/python -m pytest -q -ra tests/python "$@"

# Most desktops run the AVX2 kernels: whatever this machine has, run the C++ suite and the
# Python inference tests again with the kernel level lowered to avx2 (TANDEM_ISA).
if .venv/bin/python -c 'import sys, tandem; sys.exit(tandem.hardware_isa() == "scalar")'; then
  echo "== C++ suite and Python inference tests at TANDEM_ISA=avx2 =="
  TANDEM_ISA=avx2 build/tests/tandem_tests --gtest_brief=1
  TANDEM_ISA=avx2 .venv/bin/python -m pytest -q -ra tests/python/test_hf_inference.py tests/python/test_truth_hf.py \
    tests/python/test_pool_attention.py
else
  echo "== no AVX2 on this CPU: the TANDEM_ISA=avx2 pass is skipped =="
fi

echo "== all tests passed in $(( $(date +%s) - start )) s =="
