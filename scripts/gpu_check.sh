#!/usr/bin/env bash
# The checks tandem's CPU-only test run cannot do, on a machine with an NVIDIA GPU
# (H100 / H200: CUDA 13, Python with torch, transformers, peft, pybind11, cmake, ninja),
# which may lack tandem's system libraries (oneDNN, hwloc, libnuma, libyaml) and network.
#
#   scripts/gpu_check.sh [--build-dir DIR] [--no-python] [--no-bench] [--no-run]
#
# Steps (each PASS / FAIL / SKIP in the closing table; the exit status is 1 when any step
# FAILed, 2 when there is no GPU at all):
#   1 report    the GPU (nvidia-smi), the CPU and its AMX flags, Python / torch
#   2 build     a prebuilt build dir carried here (default build-gpu/, made on a build
#               machine by scripts/pack_gpu_build.sh: binaries for sm_90 plus the shared
#               libraries they need in build-gpu/lib); or, when there is none and the
#               system libraries are present, a fresh CUDA build in build-gpu-local/.
#               CUDA's own libraries (cuBLAS, NCCL) come from the CUDA toolkit or torch's
#               nvidia-* wheels, found and put on LD_LIBRARY_PATH.
#   3 cuda      the GoogleTest suite's CUDA instances (Streams/Hybrid.*/cuda, Gpu.*); a
#               skipped one fails the step (a GPU is here, so it must run)
#   4 amx       the AMX kernel instances (AllLevels/*/amx*) when the CPU has amx_tile
#   5 python    tandem._C built here for this Python (g++ against the carried libtandem.a),
#               then pytest's CUDA tests (tests/python -k cuda)
#   6 bench     bench_hybrid --stream cuda (a short run)
#   7 run       `tandem run` with the demo model on cuda:0 (with a Chrome trace), and on the
#               CPU alone for comparison
#   8 decode    bench/bench_cuda_decode.py: decode tokens/s of plain transformers on cuda:0,
#               tandem on cuda:0 (default and side stream) and tandem on the CPU, with the
#               experts calls' host and stream time per token
# Logs: $GPU_CHECK_LOGS, else $OUT/gpu_check, else /tmp/gpu_check (one file per step).
# Each step is stopped after $GPU_CHECK_STEP_TIMEOUT seconds (default 600).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

BUILD=${TANDEM_GPU_BUILD:-build-gpu}
DO_PYTHON=1 DO_BENCH=1 DO_RUN=1
while (($#)); do
  case $1 in
    --build-dir) BUILD=$2; shift 2 ;;
    --no-python) DO_PYTHON=0; shift ;;
    --no-bench) DO_BENCH=0; shift ;;
    --no-run) DO_RUN=0; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
STEP_TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-600}  # seconds one step may run (a hang must not eat a short lease)
LOGS=${GPU_CHECK_LOGS:-${OUT:-/tmp}/gpu_check}
mkdir -p "$LOGS"

names=() results=() notes=()
record() { names+=("$1"); results+=("$2"); notes+=("$3"); printf '\033[1m[gpu_check]\033[0m %-8s %-4s %s\n' "$1" "$2" "$3"; }
log() { printf '\033[1m[gpu_check]\033[0m %s\n' "$*"; }

summary() {
  echo
  printf '%-8s %-5s %s\n' step result note
  printf '%-8s %-5s %s\n' -------- ----- ----------------------------------------
  local failed=0
  for i in "${!names[@]}"; do
    printf '%-8s %-5s %s\n' "${names[$i]}" "${results[$i]}" "${notes[$i]}"
    [[ ${results[$i]} == FAIL ]] && failed=1
  done
  echo "logs: $LOGS"
  exit $failed
}

# ---- 1. report --------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check.sh: no GPU here: nvidia-smi is not on PATH. This script checks tandem on a machine with an"
  echo "NVIDIA GPU (H100 / H200); on a CPU-only machine run scripts/test.sh instead. Nothing was run."
  exit 2
fi
gpus=$(nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv,noheader 2>"$LOGS/nvidia-smi.err")
if [[ -z $gpus ]]; then
  echo "gpu_check.sh: no GPU here: nvidia-smi lists none ($(head -c 300 "$LOGS/nvidia-smi.err")). Nothing was run."
  exit 2
fi
{
  echo "GPUs (index, name, memory, driver, compute capability):"
  echo "$gpus" | sed 's/^/  /'
  echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) logical CPUs"
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  for f in avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8; do
    [[ " $flags " == *" $f "* ]] && echo "  $f: yes" || echo "  $f: no"
  done
  echo "memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "python: $("$PY" --version 2>&1); torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
  echo "nvcc: $(command -v nvcc >/dev/null && nvcc --version | tail -1 || echo none)"
} | tee "$LOGS/report.log"
cc=$(echo "$gpus" | head -1 | awk -F', ' '{print $5}')
arch=${cc/./}
amx=0
grep -qw amx_tile /proc/cpuinfo && amx=1
record report PASS "$(echo "$gpus" | head -1 | awk -F', ' '{print $2 ", sm " $5 ", " $3}'); amx_tile $([[ $amx == 1 ]] && echo yes || echo no)"

# ---- 2. build: carried or fresh --------------------------------------------------------
# Directories that hold a library, searched in the CUDA toolkit and torch's nvidia wheels.
lib_dirs=()
find_lib() {  # find_lib NAME -> prints the directory holding it, or nothing
  local name=$1 d
  local nvidia
  nvidia=$("$PY" -c 'import nvidia, os; print(" ".join(os.path.abspath(p) for p in nvidia.__path__))' 2>/dev/null)
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu \
           /usr/local/cuda-*/lib64 $nvidia; do
    [[ -d $d ]] || continue
    local hit
    hit=$(find -L "$d" -maxdepth 3 -name "$name" 2>/dev/null | head -1)
    [[ -n $hit ]] && { dirname "$hit"; return; }
  done
}
MISSING=""
resolve_libs() {  # resolve_libs BINARY: adds directories to LD_LIBRARY_PATH until ldd finds
  local bin=$1 m d  # everything; leaves what is still missing in MISSING (not a subshell: it exports)
  for _ in 1 2 3; do
    MISSING=$(ldd "$bin" 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
    [[ -z ${MISSING// /} ]] && { MISSING=""; return 0; }
    for m in $MISSING; do
      d=$(find_lib "$m")
      if [[ -n $d && ":${LD_LIBRARY_PATH:-}:" != *":$d:"* ]]; then
        lib_dirs+=("$d")
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      fi
    done
  done
  MISSING=$(ldd "$bin" 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
  [[ -z ${MISSING// /} ]]
}

build_ok=0
if [[ -x $BUILD/tests/tandem_tests ]]; then
  export LD_LIBRARY_PATH="$root/$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  built_for=$(awk -F': ' '/^cuda_archs/ {print $2}' "$BUILD/BUILD_INFO" 2>/dev/null)
  if resolve_libs "$BUILD/tests/tandem_tests" && { [[ ! -x $BUILD/bench/bench_hybrid ]] || resolve_libs "$BUILD/bench/bench_hybrid"; }; then
    if [[ -n $built_for && ";$built_for;" != *";$arch;"* ]]; then
      record build FAIL "$BUILD/ has device code for sm_$built_for, this GPU is sm_$arch: rebuild with TANDEM_GPU_ARCHS=$arch scripts/pack_gpu_build.sh"
    else
      build_ok=1
      record build PASS "prebuilt $BUILD/ (sm_${built_for:-?}); libraries from $BUILD/lib${lib_dirs:+ and ${lib_dirs[*]}}"
    fi
  else
    record build FAIL "the binaries need $MISSING: not in $BUILD/lib, the CUDA toolkit or torch's nvidia wheels"
  fi
else
  BUILD=build-gpu-local
  log "no prebuilt build dir: configuring $BUILD/ (needs oneDNN, hwloc, libnuma, libyaml, nlohmann-json, GoogleTest)"
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_CUDA=ON -DTANDEM_CUDA_ARCHS="$arch" \
       -DTANDEM_TESTS=ON -DTANDEM_BENCH=ON -DTANDEM_PYTHON=OFF >"$LOGS/build.log" 2>&1 &&
     cmake --build "$BUILD" -j "$(nproc)" --target tandem_tests bench_hybrid >>"$LOGS/build.log" 2>&1; then
    build_ok=1
    record build PASS "built $BUILD/ here (sm_$arch)"
  else
    record build FAIL "no prebuilt build dir and no build here: $(grep -m1 -A1 'tandem needs\|CMake Error\|error:' "$LOGS/build.log" | tr -s ' \n' ' ' | cut -c1-160) (carry build-gpu/ from scripts/pack_gpu_build.sh)"
  fi
fi

# gtest_step NAME FILTER: runs the filtered tests; FAIL on a failure, a skip, or nothing run.
gtest_step() {
  local name=$1 filter=$2 logf="$LOGS/$1.log" rc
  timeout "$STEP_TIMEOUT" "$BUILD/tests/tandem_tests" --gtest_filter="$filter" >"$logf" 2>&1
  rc=$?
  local passed skipped failed
  passed=$(grep -a -c '^\[       OK \]' "$logf")
  skipped=$(grep -a -c '^\[  SKIPPED \] [A-Za-z]' "$logf")
  failed=$(grep -a '^\[  FAILED  \] [A-Za-z].*(' "$logf" | sed 's/^\[  FAILED  \] //; s/ (.*//' | tr '\n' ' ')
  if ((rc != 0)); then
    record "$name" FAIL "exit $rc; failed: ${failed:-see $logf} ($passed passed)"
  elif ((skipped > 0)); then
    record "$name" FAIL "$((skipped / 2)) skipped although this machine should run them: $(grep -a -m1 -A1 ': Skipped$' "$logf" | tail -1 | cut -c1-120)"
  elif ((passed == 0)); then
    record "$name" FAIL "no test matched $filter"
  else
    record "$name" PASS "$passed passed ($filter)"
  fi
}

# ---- 3. C++ CUDA tests, 4. AMX kernel tests ---------------------------------------------
if ((build_ok)); then
  gtest_step cuda '*/cuda:Gpu.*'
  if ((amx)); then
    gtest_step amx '*/amx:*/amx_*'
  else
    record amx SKIP "this CPU has no amx_tile"
  fi
else
  record cuda SKIP "no build"
  record amx SKIP "no build"
fi

# python_tests WHAT: imports tandem, runs pytest's CUDA tests, records the python step.
python_tests() {
  if ! PYTHONPATH="$PKG" "$PY" -c 'import tandem; print("tandem", tandem.__version__, tandem.__file__)' >>"$LOGS/python_build.log" 2>&1; then
    record python FAIL "$1 does not import: $(tail -1 "$LOGS/python_build.log" | cut -c1-160)"
    return
  fi
  py_ok=1
  pypath="$PKG"
  "$PY" -c 'import pytest' 2>/dev/null || pypath="$PKG:$root/$BUILD/pylib"
  PYTHONPATH="$pypath" timeout "$STEP_TIMEOUT" "$PY" -m pytest tests/python -k cuda -p no:cacheprovider -rs -q >"$LOGS/python.log" 2>&1
  rc=$?
  last=$(tail -1 "$LOGS/python.log")
  if ((rc != 0)); then
    record python FAIL "pytest -k cuda exit $rc: $last"
  elif grep -q 'SKIPPED.*no CUDA device' "$LOGS/python.log"; then
    record python FAIL "CUDA tests skipped: torch sees no CUDA device ($last)"
  else
    record python PASS "$1; pytest -k cuda: $last"
  fi
}

# ---- 5. the Python module for this Python, and pytest's CUDA tests ------------------------
PKG="$root/$BUILD/py"
# The compiler for a module built here: the one whose major version built libtandem.a
# (BUILD_INFO's cxx line), when this machine has it (the H200 image has g++-12 beside its
# default g++-13); else $CXX or g++, which may crash at run time (see below).
lib_major=$(awk -F': ' '/^cxx/ {print $2}' "$BUILD/BUILD_INFO" 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | tail -1 | cut -d. -f1)
if [[ -z ${CXX:-} && -n $lib_major ]] && command -v "g++-$lib_major" >/dev/null; then
  CXX=g++-$lib_major
fi
py_ok=0
if ((!DO_PYTHON)); then
  record python SKIP "--no-python"
elif ((!build_ok)); then
  record python SKIP "no build"
elif [[ ! -f $BUILD/libtandem.a ]]; then
  record python SKIP "$BUILD/libtandem.a missing (a pack_gpu_build.sh bundle has it)"
elif ! "$PY" -c 'import torch, pybind11, transformers' >/dev/null 2>&1; then
  record python SKIP "$PY lacks torch, pybind11 or transformers"
elif ext=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'); [[ -f $PKG/tandem/_C$ext ]]; then
  # Built by pack_gpu_build.sh (TANDEM_GPU_PYTHON_INCLUDE) with the compiler that built libtandem.a.
  for f in "$root"/python/tandem/*; do ln -sfn "$f" "$PKG/tandem/"; done
  log "using the prebuilt $BUILD/py/tandem/_C$ext"
  python_tests "prebuilt tandem._C$ext"
elif ! command -v "${CXX:-g++}" >/dev/null; then
  record python SKIP "no C++ compiler (${CXX:-g++}) to build tandem._C"
elif [[ ! -f $("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h ]]; then
  record python SKIP "no Python.h for $PY (the python3-dev headers)"
else
  # Only when no prebuilt module came along: this compiler may differ from the one that built
  # libtandem.a, and two libstdc++ versions' inline code in one module can crash (g++ 13 here
  # against a g++ 12 library crashed in the engine's constructor on an H200).
  mkdir -p "$PKG/tandem"
  for f in "$root"/python/tandem/*; do ln -sfn "$f" "$PKG/tandem/"; done
  # CUDA runtime (static when the toolkit is here, else torch's shared one), cuBLAS, NCCL.
  cuda_link=()
  if d=$(find_lib libcudart_static.a) && [[ -n $d ]]; then cuda_link+=("$d/libcudart_static.a")
  elif d=$(find_lib libcudart.so.13) && [[ -n $d ]]; then cuda_link+=("$d/libcudart.so.13")
  fi
  rpath="$root/$BUILD/lib"
  for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    ldd "$BUILD/tests/tandem_tests" | grep -q "$lib" || continue
    d=$(find_lib "$lib")
    [[ -n $d ]] && { cuda_link+=("$d/$lib"); rpath="$rpath:$d"; }
  done
  carried=()
  for lib in "$BUILD"/lib/libdnnl.so.* "$BUILD"/lib/libhwloc.so.* "$BUILD"/lib/libnuma.so.* "$BUILD"/lib/libyaml-0.so.*; do
    [[ -e $lib ]] && carried+=("$lib")
  done
  log "building tandem._C for $("$PY" --version)"
  if "${CXX:-g++}" -O2 -std=c++20 -shared -fPIC -fvisibility=hidden -fopenmp -DTANDEM_WITH_CUDA=1 \
       $("$PY" -m pybind11 --includes) -I cpu_kernels/include -I runtime/include -I gpu/include -I sft/include \
       python/bindings.cpp -o "$PKG/tandem/_C$ext" "$BUILD/libtandem.a" "${carried[@]}" "${cuda_link[@]}" \
       -ldl -lrt -lpthread -Wl,-rpath,"$rpath" >"$LOGS/python_build.log" 2>&1; then
    python_tests "tandem._C built for $("$PY" --version 2>&1 | cut -d' ' -f2)"
  else
    record python FAIL "building tandem._C failed: $(grep -m1 -i 'error' "$LOGS/python_build.log" | cut -c1-160)"
  fi
fi

# ---- 6. bench_hybrid on the CUDA stream --------------------------------------------------
if ((!DO_BENCH)); then
  record bench SKIP "--no-bench"
elif ((!build_ok)) || [[ ! -x $BUILD/bench/bench_hybrid ]]; then
  record bench SKIP "no bench_hybrid in $BUILD/"
elif timeout "$STEP_TIMEOUT" "$BUILD/bench/bench_hybrid" --stream cuda --shape qwen3-30b --layers 2 --tokens 1,64 --hot 0,25 \
       >"$LOGS/bench.log" 2>&1; then
  record bench PASS "bench_hybrid --stream cuda (table in $LOGS/bench.log)"
  tail -8 "$LOGS/bench.log"
else
  record bench FAIL "bench_hybrid --stream cuda exit $?: $(tail -1 "$LOGS/bench.log" | cut -c1-160)"
fi

# ---- 7. tandem run on cuda ---------------------------------------------------------------
if ((!DO_RUN)); then
  record run SKIP "--no-run"
elif ((!py_ok)); then
  record run SKIP "no tandem._C for $PY (see the python step)"
else
  export TANDEM_CACHE=${TANDEM_CACHE:-$LOGS/cache}
  # 200 new tokens: the first few carry CUDA's lazy kernel loading. The same run on the CPU
  # alone is the yardstick (in 2026-11 the CUDA decode was 10x slower: see bench/RESULTS.md),
  # and the CUDA run's Chrome trace comes back in the logs.
  if PYTHONPATH="$PKG" timeout "$STEP_TIMEOUT" "$PY" -m tandem run --device cuda:0 --max-new-tokens 200 --no-progress \
       --trace "$LOGS/run_trace.json" >"$LOGS/run.log" 2>&1; then
    PYTHONPATH="$PKG" timeout "$STEP_TIMEOUT" "$PY" -m tandem run --device cpu --max-new-tokens 200 --no-progress \
      >"$LOGS/run_cpu.log" 2>&1
    if grep -q 'device stream cuda' "$LOGS/run.log"; then
      record run PASS "cuda $(grep -m1 '^decode' "$LOGS/run.log" | sed 's/.*= //'); cpu only $(grep -m1 '^decode' "$LOGS/run_cpu.log" | sed 's/.*= //')"
    else
      record run FAIL "tandem run did not use a CUDA stream: $(grep -m1 'device stream' "$LOGS/run.log")"
    fi
  else
    record run FAIL "tandem run exit: $(tail -1 "$LOGS/run.log" | cut -c1-160)"
  fi
fi

# ---- 8. where a decode step's time goes (bench/bench_cuda_decode.py) ----------------------
if ((!DO_RUN)); then
  record decode SKIP "--no-run"
elif ((!py_ok)); then
  record decode SKIP "no tandem._C for $PY (see the python step)"
elif PYTHONPATH="$PKG" timeout "$STEP_TIMEOUT" "$PY" bench/bench_cuda_decode.py >"$LOGS/decode.log" 2>&1; then
  record decode PASS "table in $LOGS/decode.log"
  grep -A6 '^variant' "$LOGS/decode.log"
else
  record decode FAIL "bench_cuda_decode.py exit: $(tail -1 "$LOGS/decode.log" | cut -c1-160)"
fi

summary
