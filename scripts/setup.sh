#!/usr/bin/env bash
# Installs everything tandem needs on a fresh Debian machine, by package name:
# system libraries with apt-get, Python packages (pinned in requirements.txt)
# into the project virtualenv .venv, then builds the C++ tree (build/) and the
# Python package (editable). Idempotent: a second run only rebuilds what changed.
#
#   scripts/setup.sh            # everything
#   TANDEM_SKIP_APT=1 ...       # skip apt-get (already installed / no root)
#   TANDEM_BUILD_TYPE=Debug ... # CMake build type (default RelWithDebInfo)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang libclang-rt-14-dev    # libFuzzer target (tests/fuzz): clang and its fuzzer runtime
  libdnnl-dev                 # oneDNN: large-m backend and benchmark peer
  ocl-icd-opencl-dev opencl-headers  # required by Debian's dnnl CMake config
  ccache                      # the C++ build and the Python extension share objects
  libhwloc-dev hwloc          # topology, thread pinning
  libnuma-dev numactl         # NUMA memory binding
  libyaml-dev                 # placement config (libyaml: the C YAML parser)
  nlohmann-json3-dev          # safetensors header, Chrome trace
  libxxhash-dev               # expert store hashes (header-only use: XXH_INLINE_ALL)
  pybind11-dev                # C++ side of the Python module
  libgtest-dev libgmock-dev   # C++ tests
)

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [[ "${TANDEM_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "system packages present"
  fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  log "pip install -r requirements.txt (first time: several minutes, torch is large)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
else
  log "Python packages up to date"
fi

jobs=$(nproc)
log "configuring and building C++ (build/, $jobs jobs)"
cmake -S . -B build -G Ninja \
  -DCMAKE_BUILD_TYPE="${TANDEM_BUILD_TYPE:-RelWithDebInfo}" \
  -DPython_EXECUTABLE="$root/.venv/bin/python" \
  -DTANDEM_TESTS=ON -DTANDEM_BENCH=ON -DTANDEM_PYTHON=OFF >/dev/null
cmake --build build -j "$jobs"

log "installing the tandem Python package (editable)"
.venv/bin/python -m pip install -q --no-build-isolation -e .
log "done: activate with 'source .venv/bin/activate'"
