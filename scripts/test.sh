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

echo "== all tests passed in $(( $(date +%s) - start )) s =="
