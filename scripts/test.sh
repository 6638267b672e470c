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

echo "== Python tests (pytest) =="
.venv/bin/python -m pytest -q -ra tests/python "$@"

echo "== all tests passed in $(( $(date +%s) - start )) s =="
