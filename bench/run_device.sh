#!/usr/bin/env bash
# Builds kvsift on the GPU machine, runs the CUDA and CPU tests, the CUDA tests under compute-sanitizer
# (memcheck, racecheck), the decode benchmarks and the PyTorch SDPA baseline, and writes logs, JSON and a
# markdown report to the output folder. Run from the repository root. Usage:
#   bench/run_device.sh [--build DIR] [--out DIR] [--docs] [build] [test] [sanitize] [bench] [cpubench] [profile] [demo] [python] [sweep]
# --build: the CMake build folder (else $KVSIFT_DEVICE_BUILD, else build/device); --out: where logs and reports go
# (else $OUT, else device-out); --docs: sweep and profile write into this checkout's docs (the context sweep's page,
# data and plots, each method page's rows and plot, every stage table), so that `bench/run_device.sh --docs build
# sweep profile` on a GPU machine regenerates every speed table and plot of the docs in one command; without it
# they stay in --out, and bench/apply_device_docs.sh OUT puts them into the docs of another checkout. The Python
# stage builds and installs under the build folder too.
# python: the Python package built with CUDA by pip, offline from the wheels in build/wheelhouse (carried;
# docs/python.md), tests/python with torch on the GPU, then bench/model_decode.py (KVSIFT_MODEL_CONTEXTS,
# KVSIFT_MODEL_BATCHES: its shapes) and bench/torch_op_overhead.py.
# sweep: every selector's step and cuDNN SDPA from 8K to 1M tokens into $OUT/sweep_GROUP.json and
# $OUT/sdpa_sweep.jsonl; then, where the docs are (this machine's checkout may be a copy), python3
# bench/context_sweep.py --gpu NAME --pages docs docs/bench/context_sweep sdpa_sweep.jsonl sweep_*.json writes the
# sweep's page, plot and each method's rows.
# No argument: all but python, sweep, profile (Nsight Compute on four decode shapes, and bench/stage_tables.sh: every
# selector's step kernel by kernel into its docs page) and demo (kvsift_demo, whose GPU table
# only a GPU machine prints). KVSIFT_BENCH_FILTER narrows bench
# (default: every benchmark of kvsift_bench_decode, which report.py's tables all use, among them the dense
# decode against cuDNN back to back with and without PDL and between projection GEMMs; each step prints its
# start time; 'Copy|Dense|Sparse|Hybrid|ProjectionGemm' leaves out only the primitives), KVSIFT_CPUBENCH_FILTER
# cpubench (medians of 3 repetitions).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
BUILD=${KVSIFT_DEVICE_BUILD:-$PWD/build/device}
stages=()
docs=0
while (($#)); do
  case $1 in
    --docs) docs=1; shift ;;
    --build) BUILD=$(realpath -m "$2"); shift 2 ;;
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    build|test|sanitize|bench|cpubench|profile|demo|python|sweep) stages+=("$1"); shift ;;
    *) echo "bench/run_device.sh: unknown argument '$1' (stages: build test sanitize bench cpubench profile demo python sweep; options: --build DIR, --out DIR, --docs)" >&2; exit 2 ;;
  esac
done
((${#stages[@]})) || stages=(build test sanitize bench cpubench)
stages=${stages[*]}
mkdir -p "$OUT" "$BUILD"
status=0
has() { [[ " $stages " == *" $1 "* ]]; }
step() { echo "== $* ($(date +%T))"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
nvcc --version | tail -1 | tee -a "$OUT/gpu.txt"

if has build; then
  step build
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a-real \
    -DKVSIFT_INSTALL=OFF > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build "$BUILD" -j16 > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
fi
if has test; then
  step tests
  "$BUILD/tests/cuda/kvsift_cuda_tests" --gtest_brief=1 2>&1 | tee "$OUT/cuda_tests.log" | tail -15 || status=1
  "$BUILD/tests/kvsift_cpu_tests" --gtest_brief=1 2>&1 | tail -3 || status=1
fi
if has python; then
  step "python package (pip, offline, CUDA) and tests/python"
  # Into the Python that has torch when it is a venv of its own (as images that ship torch in a venv have it: a venv over
  # it would not see torch), else into a venv over the system's packages.
  py=python3
  if ! "$py" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
    [ -x "$BUILD/pyenv/bin/python" ] || python3 -m venv --system-site-packages "$BUILD/pyenv"
    py=$BUILD/pyenv/bin/python
  fi
  "$py" -m pip install -q --no-index --find-links build/wheelhouse scikit-build-core nanobind pytest || status=1
  "$py" -c "import numpy" 2>/dev/null || "$py" -m pip install -q --no-index --find-links build/wheelhouse numpy
  KVSIFT_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 "$py" -m pip install -q --no-index --no-build-isolation . \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real -C build-dir="$BUILD/python" > "$OUT/python_build.log" 2>&1 \
    || { tail -30 "$OUT/python_build.log"; status=1; }
  "$py" -m pytest -q -rs tests/python 2>&1 | tee "$OUT/python_tests.log" | tail -15 || status=1
  step "whole-model decode (bench/model_decode.py)"
  "$py" bench/model_decode.py --contexts "${KVSIFT_MODEL_CONTEXTS:-32768,131072}" --batches "${KVSIFT_MODEL_BATCHES:-1,8}" \
    --capacity --json "$OUT/model_decode.json" --markdown "$OUT/model_decode.md" 2>&1 | tail -30 || status=1
  step "the torch op path's cost over the direct call (bench/torch_op_overhead.py)"
  "$py" bench/torch_op_overhead.py > "$OUT/torch_op_overhead.txt" 2>&1 || status=1
  tail -12 "$OUT/torch_op_overhead.txt"
fi
if has sanitize; then
  # racecheck skips the top-k tests over 128K-token rows (minutes each under it); their kernels run at smaller
  # sizes in CudaTopK.HeldClustersAtSanitizerSizes and the other tests.
  racecheck_skips=CudaTopK.RowsEqualTheCpuTwinExactly:CudaTopK.A2atsDecodeStepSizes:CudaTopK.GraphReplaysEqualEagerRuns
  racecheck_skips+=:CudaTopK.GroupUnionsOfEverySizeAndLongRows
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool"
    skips='*LongContexts*'
    [[ $tool == racecheck ]] && skips+=":$racecheck_skips"
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$BUILD/tests/cuda/kvsift_cuda_tests" --gtest_brief=1 \
      --gtest_filter="-$skips" > "$OUT/sanitizer_$tool.log" 2>&1 || status=1
    tail -6 "$OUT/sanitizer_$tool.log"
  done
fi
if has bench; then
  step "benchmarks"
  "$BUILD/bench/kvsift_bench_decode" --benchmark_filter="${KVSIFT_BENCH_FILTER:-.}" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$OUT/bench_decode.json" --benchmark_out_format=json > "$OUT/bench_decode.txt" 2>&1 || status=1
  step "pytorch sdpa baseline"
  python3 bench/sdpa_baseline.py > "$OUT/sdpa.jsonl" 2> "$OUT/sdpa.err" || { tail -5 "$OUT/sdpa.err"; status=1; }
  python3 bench/report.py "$OUT/bench_decode.json" "$OUT/sdpa.jsonl" "$OUT/gpu.txt" > "$OUT/bench_decode.md"
  cat "$OUT/bench_decode.md"
fi
if has cpubench; then
  step "cpu benchmarks (host of the GPU machine)"
  { lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)"; echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"; } | tee "$OUT/cpu.txt"
  "$BUILD/bench/kvsift_bench_cpu" --benchmark_min_time=0.1 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_filter="${KVSIFT_CPUBENCH_FILTER:-Triad|Gather|InCache|K:16384|K:4096/threads:1/|TopK}" \
    > "$OUT/bench_cpu.txt" 2>&1 || status=1
  grep -E "^BM.*median" "$OUT/bench_cpu.txt" | awk '{print $1, $2, $3, $(NF-1), $NF}'
fi
if has demo; then
  step "demo"
  "$BUILD/bench/kvsift_demo" > "$OUT/demo.txt" 2>&1 || status=1
  sed -n '1,/^Real attention/p' "$OUT/demo.txt"
fi
if has sweep; then
  step "the context sweep: every selector's step and cuDNN SDPA, 8K .. 1M tokens"
  # One benchmark run (and JSON file) per series group, so that one group past a time limit loses only its rows.
  declare -A sweep=(
    [dense]='BM_DenseDecode/N:[0-9]*/batch:[18]/splits:0/pdl:1/warps:0/'
    [steps]='BM_Step/method:[0-3]/N:[0-9]*/batch:[18]/pdl:1/between:0/P:1/sort:0/alpha:0/'
    [a2ats]='BM_Step/method:4/N:[0-9]*/batch:[18]/pdl:1/between:0/P:1/sort:[01]/alpha:0/'
    [centroidkv]='BM_CentroidKVStep/'
    [specontext]='BM_SpeContextStep/mode:0/N:[0-9]*/batch:[18]/pdl:1/between:0/')
  for group in dense steps a2ats centroidkv specontext; do
    step "sweep: $group"
    "$BUILD/bench/kvsift_bench_decode" --benchmark_filter="${sweep[$group]}" --benchmark_out="$OUT/sweep_$group.json" \
      --benchmark_out_format=json > "$OUT/sweep_$group.txt" 2>&1 || status=1
  done
  KVSIFT_SDPA_N=8192,32768,131072,524288,1048576 KVSIFT_SDPA_BACKENDS=cudnn python3 bench/sdpa_baseline.py \
    > "$OUT/sdpa_sweep.jsonl" 2> "$OUT/sdpa_sweep.log" || status=1
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  python3 -c 'import json, sys; print(json.dumps({"gpu": sys.argv[1]}))' "$gpu" > "$OUT/gpu.json"
  pages=() prefix="$OUT/context_sweep"
  ((docs)) && pages=(--pages docs) prefix=docs/bench/context_sweep
  python3 bench/context_sweep.py --gpu "$gpu" "${pages[@]}" \
    "$prefix" "$OUT/sdpa_sweep.jsonl" "$OUT"/sweep_*.json && cat "$prefix.md" || status=1
fi
if has profile; then
  # One decode launch and its split merge per shape, after the warm-up calls (skip), with the sections that
  # say what limits the kernel: DRAM throughput, occupancy and its limiter, and why warps stall.
  for shape in DenseDecode/N:131072/batch:8 DenseDecode/N:32768/batch:1 SparseDecode/K:2048/batch:8/clustered:0 \
               SparseDecode/K:2048/batch:1/clustered:0; do
    step "ncu $shape"
    log="$OUT/ncu_$(echo "$shape" | tr '/:' '__').txt"
    ncu --clock-control none --kernel-name regex:'decode_attention|merge_splits' --launch-skip 6 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      "$BUILD/bench/kvsift_bench_decode" --benchmark_filter="^BM_$shape/splits:0/pdl:1/warps:0/" > "$log" 2>&1 || status=1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit (Reg|Shared)|Issued Warp Per|No Eligible|Warp Cycles Per Issued" "$log" \
      | sed -E 's/ +/ /g' | cut -c1-110
  done
  step "stage tables"
  # With --docs into the pages; else the tables travel in $OUT/stage_tables/ (this checkout may be a copy).
  if ((docs)); then
    bash bench/stage_tables.sh "$BUILD/bench/kvsift_bench_decode" || status=1
  else
    bash bench/stage_tables.sh --tables "$OUT/stage_tables" "$BUILD/bench/kvsift_bench_decode" || status=1
  fi
fi
# The device tool returns at most 8 files: the logs travel as one archive beside the report and JSON.
(cd "$OUT" && logs=$(ls | grep -v -E '\.(md|json|jsonl)$|^logs\.tar\.gz$') && [[ -n "$logs" ]] && tar czf logs.tar.gz $logs && rm -f $logs)
exit $status
