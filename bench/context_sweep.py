"""One decode step of one layer against context length (8K .. 1M tokens) at batch 1 and 8, for
cuDNN SDPA, kvsift's dense decode, and the Quest and OracleTopK steps (q_heads 32, kv_heads 8, head_dim 128, bf16,
2048 selected tokens; GPU time of CUDA graph replays, one run each, cuDNN on the same machine).

Reads sdpa_baseline.py's JSON lines and kvsift_bench_decode's JSON files (BM_DenseDecode and BM_Step rows); writes
PREFIX.md (the table) and PREFIX.dat, and PREFIX.svg through gnuplot where it is installed.

Usage: context_sweep.py [--gpu NAME] PREFIX sdpa.jsonl bench_decode.json [bench_decode.json ...]"""
import json
import re
import shutil
import subprocess
import sys

SERIES = ("cuDNN SDPA", "kvsift dense", "Quest step", "OracleTopK step")
METHODS = {0: "Quest step", 1: "OracleTopK step"}


def read_bench(path):
    """(series, N, batch) -> microseconds, from the plain (not aggregate) rows."""
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        name = b["run_name"]
        dense = re.match(r"BM_DenseDecode/N:(\d+)/batch:(\d+)/splits:0/pdl:1/warps:0(/|$)", name)
        step = re.match(r"BM_Step/method:([01])/N:(\d+)/batch:(\d+)/pdl:1/between:0/P:1/sort:0/alpha:0", name)
        if dense:
            out[("kvsift dense", int(dense[1]), int(dense[2]))] = b["real_time"]
        elif step:
            out[(METHODS[int(step[1])], int(step[2]), int(step[3]))] = b["real_time"]
    return out


def read_sdpa(path, out):
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("backend") == "cudnn" and "graph_us" in r:
            out[("cuDNN SDPA", r["N"], r["batch"])] = r["graph_us"]


def main(gpu, prefix, sdpa_jsonl, *bench_jsons):
    times = {}
    for path in bench_jsons:
        times.update(read_bench(path))
    read_sdpa(sdpa_jsonl, times)
    lengths = sorted({n for (_, n, _) in times})
    name = prefix.rsplit("/", 1)[-1]
    with open(prefix + ".md", "w") as md, open(prefix + ".dat", "w") as dat:
        md.write(f"# The context sweep{', ' + gpu if gpu else ''}\n\n" + " ".join(__doc__.split("\n\n")[0].split()) +
                 f"\n\nThe plot: [{name}.svg]({name}.svg); the data: [{name}.dat]({name}.dat). Made by `python3 "
                 f"bench/context_sweep.py{' --gpu ' + repr(gpu) if gpu else ''} {prefix} sdpa.jsonl sweep.json` (docs/quest.md has the benchmark "
                 "commands); the GPU and the run are in docs/device_runs.md.\n\n")
        md.write("| N | batch | " + " | ".join(SERIES) + " | cuDNN / Quest | cuDNN / OracleTopK |\n")
        md.write("|---" * (len(SERIES) + 4) + "|\n")
        for batch in (1, 8):
            dat.write(f"# batch {batch}: N " + " ".join(s.replace(" ", "_") for s in SERIES) + "\n")
            for n in lengths:
                row = [times.get((s, n, batch)) for s in SERIES]
                if all(t is None for t in row):
                    continue
                cells = [f"{t:.1f} µs" if t is not None else "—" for t in row]
                ratios = [f"{row[0] / t:.2f}×" if row[0] and t else "—" for t in (row[2], row[3])]
                md.write(f"| {n // 1024}K | {batch} | " + " | ".join(cells + ratios) + " |\n")
                dat.write(f"{n} " + " ".join(f"{t:.2f}" if t is not None else "NaN" for t in row) + "\n")
            dat.write("\n\n")
    if shutil.which("gnuplot"):
        columns = ", ".join(f"'{prefix}.dat' index {i} using 1:{c + 2} with linespoints title '{s}, batch {b}'"
                            for i, b in enumerate((1, 8)) for c, s in enumerate(SERIES))
        script = (f"set terminal svg size 1000,520 noenhanced; set output '{prefix}.svg'; set logscale xy; "
                  "set xlabel 'context (tokens)'; set ylabel 'µs per step (one layer)'; set key outside right top; "
                  "set xrange [6000:1400000]; set xtics ('8K' 8192, '32K' 32768, '128K' 131072, '512K' 524288, "
                  "'1M' 1048576); set grid; plot " + columns)
        subprocess.run(["gnuplot", "-e", script], check=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    gpu = ""
    if args[:1] == ["--gpu"] and len(args) > 1:
        gpu, args = args[1], args[2:]
    if len(args) < 3:
        sys.exit(__doc__)
    main(gpu, *args)
