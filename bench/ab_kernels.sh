#!/usr/bin/env bash
# In-core A/B of one ISA's GEMM kernel: the cpu_kernels/ sources at git revision REV
# against the working tree's, each compiled into bench/ab_kernels_main.cpp's harness, run
# alternately on one pinned thread with the packed weights resident in the caches. Prints
# each round's GOP/s, the median ratio new / old, and whether the two outputs have the
# same bits. For kernel changes whose effect the DRAM-fed bench_kernels cannot resolve
# through a shared machine's bandwidth swings; the packed layouts must be the same at REV
# (packing comes from build/libtandem_kernels.a).
#
#   bench/ab_kernels.sh REV SUFFIX FORMAT N K M [GROUP] [ROUNDS]
#   bench/ab_kernels.sh HEAD~1 avx2 bf16 128 4096 64          # AVX2 BF16, 2 panels, 64 rows
#   bench/ab_kernels.sh HEAD~1 avx512vnni int4 256 4096 64 32  # VNNI INT4, groups of 32
#
# SUFFIX: avx2, avxvnni, avx512, avx512vnni, avx512bf16 (the ISA file suffixes of
# cpu_kernels/kernel_list.inc; the CPU must run that ISA). Size N x K so the packed weight
# fits the L2 (bf16 N*K*2 bytes, int8 N*K, int4 about N*K/2).
set -euo pipefail
if [ $# -lt 6 ]; then sed -n '2,17p' "$0"; exit 2; fi
rev=$1 suffix=$2 fmt=$3 n=$4 k=$5 m=$6 group=${7:-128} rounds=${8:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TANDEM_BUILD:-$root/build}
[ -f "$build/libtandem_kernels.a" ] || { echo "ab_kernels: no $build/libtandem_kernels.a (build first, or set TANDEM_BUILD)" >&2; exit 2; }
flags="-O3 -fno-trapping-math -mavx2 -mfma -mf16c"
case $suffix in
  avx2) ;;
  avxvnni) flags="$flags -mavxvnni" ;;
  avx512) flags="$flags -mavx512f -mavx512bw -mavx512vl -mavx512dq" ;;
  avx512vnni) flags="$flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni" ;;
  avx512bf16) flags="$flags -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16" ;;
  *) echo "ab_kernels: SUFFIX must be avx2, avxvnni, avx512, avx512vnni or avx512bf16, not '$suffix'" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old" "$work/new"
git -C "$root" rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "ab_kernels: no commit '$rev'" >&2; exit 2; }
for f in $(git -C "$root" ls-tree --name-only "$rev" cpu_kernels/ | grep -E '\.(h|cpp|inc)$'); do
  git -C "$root" show "$rev:$f" > "$work/old/$(basename "$f")"
done
cp "$root"/cpu_kernels/*.h "$root"/cpu_kernels/*.cpp "$root"/cpu_kernels/*.inc "$work/new/"
for side in old new; do
  files="" q="" b=""
  [ -f "$work/$side/gemm_bf16_$suffix.cpp" ] && { files="$files#include \"gemm_bf16_$suffix.cpp\"\n"; b=-DAB_HAS_BF16; }
  [ -f "$work/$side/gemm_q_$suffix.cpp" ] && { files="$files#include \"gemm_q_$suffix.cpp\"\n"; q=-DAB_HAS_Q; }
  printf "$files" > "$work/$side/ab_all.cpp"
  # shellcheck disable=SC2086
  g++ -std=c++20 $flags -fopenmp $q $b -DAB_SUFFIX="$suffix" -DAB_ISA_FILES='"ab_all.cpp"' \
    -iquote "$work/$side" -I "$root/cpu_kernels/include" "$root/bench/ab_kernels_main.cpp" \
    "$build/libtandem_kernels.a" "$build/libtandem_base.a" -fopenmp -o "$work/ab_$side"
done
cpu=$(taskset -pc $$ 2>/dev/null | sed 's/.*: *//; s/[,-].*//')
echo "ab_kernels: $suffix $fmt ${n}x$k, $m rows$([ "$fmt" = int4 ] && echo ", group $group"); old = $rev, new = the working tree; one thread on cpu ${cpu:-0}"
ratios=() sums=()
for r in $(seq "$rounds"); do
  o=$(OMP_NUM_THREADS=1 taskset -c "${cpu:-0}" "$work/ab_old" "$fmt" "$n" "$k" "$m" "$group")
  w=$(OMP_NUM_THREADS=1 taskset -c "${cpu:-0}" "$work/ab_new" "$fmt" "$n" "$k" "$m" "$group")
  echo "  round $r: old $o"
  echo "           new $w"
  ratios+=("$(awk -v a="${o%% *}" -v b="${w%% *}" 'BEGIN { printf "%.3f", b / a }')")
  sums+=("$(echo "$o" | awk '{print $4}')" "$(echo "$w" | awk '{print $4}')")
done
median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR] = $1} END { print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2) }')
same=$([ "$(printf '%s\n' "${sums[@]}" | sort -u | wc -l)" = 1 ] && echo "the same bits" || echo "DIFFERENT bits")
echo "new / old: ${ratios[*]} (median ${median}x); outputs: $same"
