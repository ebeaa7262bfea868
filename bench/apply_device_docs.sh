#!/usr/bin/env bash
# The docs' speed tables and plots from the output folder of `bench/run_device.sh sweep profile` run on a GPU machine
# whose checkout was a copy: the context sweep (its page, data, plots, each method page's rows and plot) and every
# stage table, into this checkout's docs. No GPU needed. Usage: bench/apply_device_docs.sh OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath "$1")
cd "$root"
if [ -f "$out/sdpa_sweep.jsonl" ]; then
  gpu=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["gpu"])' "$out/gpu.json")
  python3 bench/context_sweep.py --gpu "$gpu" --pages docs docs/bench/context_sweep "$out/sdpa_sweep.jsonl" \
    "$out"/sweep_*.json > /dev/null
  echo "apply_device_docs: the context sweep ($gpu) -> docs/bench/context_sweep.{md,dat,svg}, each method page"
fi
tables=$out/stage_tables
if [ ! -d "$tables" ] && tar tzf "$out/logs.tar.gz" stage_tables > /dev/null 2>&1; then  # run_device.sh's archive
  tables=$(mktemp -d)
  tar xzf "$out/logs.tar.gz" -C "$tables" stage_tables
  tables=$tables/stage_tables
fi
if [ -d "$tables" ]; then
  bash bench/stage_tables.sh --apply "$tables"
fi
