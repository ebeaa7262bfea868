"""The latency model of one decode step, kernel by kernel: Nsight Compute profiles the kernels of the one eager call
that a benchmark timed by time_calls (bench/gpu_bench.hpp) runs alone in the NVTX range "kvsift step" when
KVSIFT_PROFILE_ONE_STEP is set, one at a time, and this prints per kernel its launches, the DRAM bytes it read and
wrote, the floor (bytes / copy bandwidth), its GPU time and the time over the floor, then the step's sums. Kernels
profiled one by one run without the overlap PDL gives a graph replay, so the sum is an upper bound on the replayed
step (the benchmark's time). bench/stage_tables.sh writes every selector's table into its docs page.

Usage (GPU machine, repository root, after building kvsift_bench_decode):
  python3 bench/stage_table.py BENCH_BINARY 'BM_Step/method:0/N:131072/batch:1/pdl:1/between:0/P:1/sort:0/alpha:0'
      [--bandwidth 4.2e12] [--ncu ncu]
BM_Step's method: 0 Quest, 1 OracleTopK, 2 CTKVR, 3 CSAttention, 4 A2ATS, 5 Quest + rerank; also
BM_CentroidKVStep, BM_SpeContextStep (a model's step over its layers), BM_DenseDecode, BM_StepStage."""
import argparse
import csv
import io
import os
import subprocess
import sys
from collections import OrderedDict

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")


def profile(binary, bench_filter, ncu):
    """Nsight Compute's CSV rows (one per kernel launch) of the NVTX range's kernels."""
    command = [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--nvtx", "--nvtx-include", "kvsift step/",
               "--metrics", ",".join(METRICS), binary, f"--benchmark_filter={bench_filter}"]
    environment = dict(os.environ, KVSIFT_PROFILE_ONE_STEP="1")  # time_calls runs one call in the range, then skips
    text = subprocess.run(command, check=True, capture_output=True, text=True, env=environment).stdout
    start = text.find('"ID"')
    if start < 0:
        sys.exit("stage_table.py: Nsight Compute profiled no kernel in the range 'kvsift step'")
    return list(csv.DictReader(io.StringIO(text[start:])))


def to_unit(value, unit):
    """A metric value in seconds (time) or bytes."""
    x = float(value.replace(",", ""))
    scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3,
             "s": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "B": 1.0, "KB": 1e3,
             "MB": 1e6, "GB": 1e9, "TB": 1e12}
    return x * scale[unit]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binary")
    parser.add_argument("filter", help="one benchmark timed by time_calls (its full name up to its last argument)")
    parser.add_argument("--bandwidth", type=float, default=4.2e12, help="copy bandwidth, bytes/s (BM_CopyBandwidth)")
    parser.add_argument("--ncu", default="ncu")
    args = parser.parse_args()
    kernels = OrderedDict()  # in launch order of first appearance
    for row in profile(args.binary, args.filter, args.ncu):
        name = row["Kernel Name"].split("(")[0].split("<")[0].replace("void ", "").strip()
        entry = kernels.setdefault(name, {"launches": 0, "seconds": 0.0, "bytes": 0.0})
        value = to_unit(row["Metric Value"], row["Metric Unit"])
        if row["Metric Name"] == METRICS[0]:
            entry["launches"] += 1
            entry["seconds"] += value
        else:
            entry["bytes"] += value
    print(f"{args.filter}: the eager step's kernels one by one (Nsight Compute), floor at {args.bandwidth / 1e12:.2f} TB/s\n")
    print("| kernel | launches | MB | floor µs | µs | × floor |")
    print("|---|---|---|---|---|---|")
    total = {"launches": 0, "seconds": 0.0, "bytes": 0.0}
    for name, e in kernels.items():
        floor = e["bytes"] / args.bandwidth
        ratio = f"{e['seconds'] / floor:.1f}" if floor > 1e-7 else "—"
        print(f"| {name} | {e['launches']} | {e['bytes'] / 1e6:.2f} | {floor * 1e6:.2f} | {e['seconds'] * 1e6:.1f} | {ratio} |")
        for key in total:
            total[key] += e[key]
    floor = total["bytes"] / args.bandwidth
    print(f"| the step | {total['launches']} | {total['bytes'] / 1e6:.2f} | {floor * 1e6:.2f} | "
          f"{total['seconds'] * 1e6:.1f} | {total['seconds'] / floor:.1f} |")


if __name__ == "__main__":
    main()
