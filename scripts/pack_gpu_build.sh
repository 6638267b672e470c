#!/usr/bin/env bash
# Builds, on this (build) machine, what scripts/gpu_check.sh needs on a GPU machine that
# has CUDA, Python and torch but none of tandem's system libraries (oneDNN, hwloc, libnuma,
# libyaml) and no network: a small, self-contained build-gpu/ to carry there.
#
#   scripts/pack_gpu_build.sh            # -> build-gpu/ (the CMake tree stays in build-gpu-work/)
#   TANDEM_GPU_ARCHS="90" ...            # device code (default 90: H100 / H200)
#   TANDEM_GPU_MAX_MIB=60 ...            # fail when build-gpu/ is larger (default 60)
#   TANDEM_GPU_PYTHON_INCLUDE=DIR ...    # also build tandem._C here for the GPU machine's Python,
#                                        # from its headers (DIR holds Python.h; a copy of its
#                                        # include/python3.X, with include/<triplet>/python3.X
#                                        # beside it where pyconfig.h points there)
#   TANDEM_GPU_PYTHON_SUFFIX=.cpython-312-x86_64-linux-gnu.so  # that Python's EXT_SUFFIX
#                                        # (default: derived from DIR's name, python3.X)
#
# build-gpu/ holds (same layout as a build tree, so gpu_check.sh treats both alike):
#   tests/tandem_tests     the GoogleTest suite (CUDA ON, sm_<archs>), stripped
#   bench/bench_hybrid     the hybrid scheduler benchmark, stripped
#   libtandem.a            the library (debug info stripped), to link the Python module there
#   lib/                   the shared libraries ldd names that a bare CUDA machine lacks:
#                          oneDNN, hwloc, libnuma, libyaml, OpenMP and their own dependencies;
#                          not glibc / libstdc++ / libgcc (any Linux has them; this machine's
#                          glibc is the oldest one the binaries need) and not CUDA's libraries
#                          (cuBLAS, NCCL, the driver: the GPU machine's toolkit or torch has them)
#   pylib/                 pytest and its pure-Python dependencies, for a Python without them
#   py/tandem/_C*.so       with TANDEM_GPU_PYTHON_INCLUDE: the module, built by the compiler that
#                          built libtandem.a. Linking bindings.cpp there with another compiler
#                          mixes two libstdc++ headers' inline code in one module; on an H200 with
#                          g++ 13 against this g++ 12 library the engine's constructor crashed.
#   BUILD_INFO             what was built, where, with which compilers
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
OUT=build-gpu
WORK=build-gpu-work
ARCHS=${TANDEM_GPU_ARCHS:-90}
MAX_MIB=${TANDEM_GPU_MAX_MIB:-60}
PY=${PYTHON:-$root/.venv/bin/python}

log() { printf '\033[1m[pack]\033[0m %s\n' "$*"; }
die() { printf '\033[1m[pack]\033[0m error: %s\n' "$*" >&2; exit 1; }

command -v nvcc >/dev/null || die "nvcc is not on PATH: the GPU build needs the CUDA toolkit here (export PATH=/usr/local/cuda/bin:\$PATH)"
command -v cmake >/dev/null && command -v ninja >/dev/null || die "needs cmake and ninja (apt-get install cmake ninja-build)"

log "configuring $WORK/ (CUDA ON, sm_$ARCHS, tests and benchmarks on, Python off)"
cmake -S . -B "$WORK" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_CUDA=ON -DTANDEM_CUDA_ARCHS="$ARCHS" \
  -DTANDEM_TESTS=ON -DTANDEM_BENCH=ON -DTANDEM_PYTHON=OFF >/dev/null
log "building tandem_tests and bench_hybrid ($(nproc) jobs; nvcc is slow)"
cmake --build "$WORK" -j "$(nproc)" --target tandem_tests bench_hybrid

rm -rf "$OUT"
mkdir -p "$OUT/tests" "$OUT/bench" "$OUT/lib"
cp "$WORK/tests/tandem_tests" "$OUT/tests/"
cp "$WORK/bench/bench_hybrid" "$OUT/bench/"
cp "$WORK/libtandem.a" "$OUT/"
strip --strip-unneeded "$OUT/tests/tandem_tests" "$OUT/bench/bench_hybrid"
strip --strip-debug "$OUT/libtandem.a"

# Shared libraries: everything ldd resolves, minus the C/C++ runtime every Linux has and
# CUDA's own libraries (the GPU machine's driver, toolkit or torch wheels provide those).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libresolv|libstdc\+\+|libgcc_s|libcuda\.so|libcudart|libcublas|libcublasLt|libnccl|libnvrtc|libnvJitLink|libcusparse|libcufft|libcurand)'
for bin in "$OUT/tests/tandem_tests" "$OUT/bench/bench_hybrid"; do
  while read -r name _ path _; do
    [[ -n ${path:-} && $path == /* ]] || continue
    [[ $name =~ $skip ]] && continue
    [[ -e "$OUT/lib/$name" ]] || cp -L "$path" "$OUT/lib/$name"
  done < <(ldd "$bin")
done
# libtandem.a links these too (the Python module built on the GPU machine needs them by name).
for name in libdnnl.so.2 libhwloc.so.15 libnuma.so.1 libyaml-0.so.2; do
  [[ -e "$OUT/lib/$name" ]] || log "warning: $name is not among the libraries ldd named"
done
chmod 644 "$OUT"/lib/*

# The Python module for the GPU machine's Python, built here (same compiler as libtandem.a).
if [[ -n ${TANDEM_GPU_PYTHON_INCLUDE:-} ]]; then
  inc=$TANDEM_GPU_PYTHON_INCLUDE
  [[ -f $inc/Python.h ]] || die "TANDEM_GPU_PYTHON_INCLUDE=$inc has no Python.h"
  ver=$(basename "$inc")                      # python3.12 -> .cpython-312-x86_64-linux-gnu.so
  ver=${ver#python}
  suffix=${TANDEM_GPU_PYTHON_SUFFIX:-.cpython-${ver//./}-x86_64-linux-gnu.so}
  cuda_lib=$(dirname "$(command -v nvcc)")/../lib64
  [[ -f $cuda_lib/libcudart_static.a ]] || die "no libcudart_static.a in $cuda_lib"
  nccl=()
  ldd "$OUT/tests/tandem_tests" | grep -q libnccl && nccl=(-l:libnccl.so.2)
  mkdir -p "$OUT/py/tandem"
  log "building tandem._C$suffix for the headers in $inc"
  "${CXX:-c++}" -O2 -std=c++20 -shared -fPIC -fvisibility=hidden -fopenmp -DTANDEM_WITH_CUDA=1 \
    -I"$inc" -I"$(dirname "$inc")" $("$PY" -c 'import pybind11; print("-I" + pybind11.get_include())') \
    -I cpu_kernels/include -I runtime/include -I gpu/include -I sft/include \
    python/bindings.cpp -o "$OUT/py/tandem/_C$suffix" "$WORK/libtandem.a" \
    -L"$OUT/lib" -l:libdnnl.so.2 -l:libhwloc.so.15 -l:libnuma.so.1 -l:libyaml-0.so.2 \
    "$cuda_lib/libcudart_static.a" -L"$cuda_lib" -L"$(dirname "$(ldd "$OUT/tests/tandem_tests" | awk '/libcublas.so/ {print $3}')")" \
    -l:libcublas.so.13 -l:libcublasLt.so.13 "${nccl[@]}" -ldl -lrt -lpthread -Wl,-rpath,'$ORIGIN/../../lib'
  strip --strip-unneeded "$OUT/py/tandem/_C$suffix"
fi

# pytest for a Python that lacks it (pure Python: any 3.x the GPU machine has).
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ ${TANDEM_GPU_PYLIB:-1} == 1 ]]; then  # TANDEM_GPU_PYLIB=0: the GPU machine has pytest (6 MiB less)
  mkdir -p "$OUT/pylib"
  for p in _pytest pytest pluggy iniconfig packaging pygments py.py; do
    [[ -e "$site/$p" ]] && cp -r "$site/$p" "$OUT/pylib/"
  done
  for d in "$site"/{pytest,pluggy,iniconfig,packaging,pygments}-*.dist-info; do cp -r "$d" "$OUT/pylib/"; done
  find "$OUT/pylib" -name __pycache__ -type d -prune -exec rm -rf {} +
fi

{
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "cuda_archs: $ARCHS"
  echo "nvcc: $(nvcc --version | tail -1)"
  echo "cxx: $(c++ --version | head -1)"
  echo "glibc: $(ldd --version | head -1)"
  echo "python_for_pylib: $("$PY" --version)"
  echo "python_module: $(cd "$OUT" && ls py/tandem/_C* 2>/dev/null || echo none)"
  echo "libs: $(cd "$OUT/lib" && ls | tr '\n' ' ')"
  echo "needs_at_runtime: libcublas.so.13 libcublasLt.so.13 $(ldd "$OUT/tests/tandem_tests" | grep -o 'libnccl[^ ]*' | head -1) and the NVIDIA driver (libcuda.so.1)"
} > "$OUT/BUILD_INFO"

log "contents of $OUT/:"
(cd "$OUT" && du -b tests/tandem_tests bench/bench_hybrid libtandem.a lib/* | sort -rn | awk '{printf "  %8.1f MiB  %s\n", $1 / 1048576, $2}')
[[ -d $OUT/pylib ]] && printf '  %8.1f MiB  pylib/ (pytest)\n' "$(du -sb "$OUT/pylib" | awk '{print $1 / 1048576}')"
[[ -d $OUT/py ]] && printf '  %8.1f MiB  py/ (tandem._C)\n' "$(du -sb "$OUT/py" | awk '{print $1 / 1048576}')"
total=$(du -sb "$OUT" | awk '{print $1}')
mib=$(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1048576}')
log "total: $mib MiB (limit $MAX_MIB MiB)"
if awk -v b="$total" -v m="$MAX_MIB" 'BEGIN {exit !(b > m * 1048576)}'; then
  die "$OUT/ is $mib MiB, over the $MAX_MIB MiB limit"
fi
log "done: carry $OUT/ to the GPU machine and run scripts/gpu_check.sh there"
