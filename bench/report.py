"""Turns kvsift_bench_decode's JSON and sdpa_baseline.py's JSON lines into the markdown tables of
docs/bench/ (dense against SDPA, dense against cuDNN with and without PDL and between GEMMs, sparse, split
counts, placement, PDL, warps, hybrid). Usage: report.py bench_decode.json sdpa.jsonl gpu.txt"""
import json
import re
import sys


def medians(path):
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        name = b["run_name"]
        out[name] = {"us": b["real_time"], "gbs": b.get("GB/s", 0) / 1e9, "bytes": b.get("bytes", 0),
                     "eager_us": b.get("eager_us", 0), "cpu_us": b.get("cpu_us", 0),
                     "gpu_window_us": b.get("gpu_window_us", 0), "K": b.get("K", 0),
                     "mb": b.get("MB", 0), "floor_us": b.get("floor_us", 0), "x_floor": b.get("x_floor", 0),
                     "launches": b.get("launches", 0), "label": b.get("label", "")}
    return out


def main(bench_json, sdpa_jsonl, gpu_txt):
    runs = medians(bench_json)
    sdpa = [json.loads(line) for line in open(sdpa_jsonl) if line.strip()]
    copy = next(v for k, v in runs.items() if k.startswith("BM_CopyBandwidth"))
    print(f"GPU: {open(gpu_txt).read().strip().splitlines()[1]}")
    print(f"\nMeasured device-to-device copy: {copy['gbs']:.0f} GB/s (bytes read + written).\n")
    short = [(int(re.match(r"BM_ShortCopy/MiB:(\d+)", k)[1]), r) for k, r in runs.items() if k.startswith("BM_ShortCopy")]
    if short:
        print("Short copies timed like the decode calls (graph replays): " + "; ".join(
            f"{mib} MiB ({2 * mib} MiB of traffic) in {r['us']:.1f} us = {r['gbs']:.0f} GB/s" for mib, r in short) + ".\n")
    print("### Dense decode (q_heads 32, kv_heads 8, head_dim 128, bf16): kvsift vs PyTorch SDPA\n")
    print("Both sides timed the same two ways. graph: GPU time per call from replays of a CUDA graph of 16 calls.")
    print("eager: median of event timings around back-to-back direct calls (no synchronization between them).\n")
    print("| N | batch | kvsift us | GB/s | % of copy | SDPA flash us | SDPA cuDNN us | kvsift / cuDNN | "
          "kvsift eager us | cuDNN eager us | kvsift / cuDNN, eager |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        m = re.match(r"BM_DenseDecode/N:(\d+)/batch:(\d+)/splits:0/pdl:1/warps:0(/|$)", name)
        if not m:
            continue
        n, batch = int(m[1]), int(m[2])
        def sd(backend, key):
            hit = [s for s in sdpa if s["backend"] == backend and s["N"] == n and s["batch"] == batch]
            return hit[0].get(key) if hit else None
        fmt = lambda x: f"{x:.1f}" if x else "n/a"
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "n/a"
        cudnn, cudnn_eager = sd("cudnn", "graph_us"), sd("cudnn", "us")
        print(f"| {n} | {batch} | {r['us']:.1f} | {r['gbs']:.0f} | {100 * r['gbs'] / copy['gbs']:.0f}% | "
              f"{fmt(sd('flash', 'graph_us'))} | {fmt(cudnn)} | {ratio(r['us'], cudnn)} | "
              f"{fmt(r['eager_us'])} | {fmt(cudnn_eager)} | {ratio(r['eager_us'], cudnn_eager)} |")
    errors = [s for s in sdpa if s["backend"] != "gemm" and ("error" in s or "graph_error" in s)]
    for e in errors[:4]:
        print(f"\nSDPA {e['backend']} N={e['N']} batch={e['batch']} refused: {e.get('error') or e['graph_error']}")
    print("\n### Sparse decode over a 128K-token cache (q_heads 32, kv_heads 8, head_dim 128, bf16)\n")
    print("| K | batch | indices | us (graph) | eager us | GB/s touched | % of copy |")
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        m = re.match(r"BM_SparseDecode/K:(\d+)/batch:(\d+)/clustered:(\d)/splits:0/pdl:1/warps:0(/window:0)?(/|$)", name)
        if m:
            print(f"| {m[1]} | {m[2]} | {'clustered' if m[3] == '1' else 'random'} | {r['us']:.1f} | {r['eager_us']:.1f} | "
                  f"{r['gbs']:.0f} | {100 * r['gbs'] / copy['gbs']:.0f}% |")


def versus_cudnn(runs, sdpa_jsonl):
    """kvsift dense against cuDNN SDPA three ways: back to back with PDL (kvsift's default), back to back
    without it, and with a projection GEMM between calls (BM_DenseInterleaved / BM_ProjectionGemm against
    sdpa_baseline.py's pair_us and gemm lines)."""
    sdpa = [json.loads(line) for line in open(sdpa_jsonl) if line.strip()]

    def bench(pattern):
        hit = [r for k, r in runs.items() if re.match(pattern + r"(/|$)", k)]
        return hit[0]["us"] if hit else None

    def cudnn(n, batch):
        hit = [x for x in sdpa if x["backend"] == "cudnn" and x["N"] == n and x["batch"] == batch]
        return hit[0] if hit else {}

    def torch_gemm(batch, mode):
        hit = [x for x in sdpa if x["backend"] == "gemm" and x["batch"] == batch]
        return hit[0].get(f"{mode}_us") if hit else None

    shapes = [(n, b) for n in (32768, 131072) for b in (1, 8)]
    rows = []
    for n, b in shapes:
        c = cudnn(n, b)
        mode = c.get("pair_mode", "graph")
        r = {"n": n, "batch": b, "cudnn": c.get("graph_us"), "cudnn_pair": c.get("pair_us"), "mode": mode,
             "torch_gemm": torch_gemm(b, mode),
             "pdl": bench(rf"BM_DenseDecode/N:{n}/batch:{b}/splits:0/pdl:1/warps:0"),
             "nopdl": bench(rf"BM_DenseDecode/N:{n}/batch:{b}/splits:0/pdl:0/warps:0"),
             "pair": bench(rf"BM_DenseInterleaved/N:{n}/batch:{b}/pdl:1"),
             "pair_nopdl": bench(rf"BM_DenseInterleaved/N:{n}/batch:{b}/pdl:0"),
             "gemm": bench(rf"BM_ProjectionGemm/batch:{b}")}
        minus = lambda a, g: a - g if a is not None and g is not None else None
        r["share"], r["share_nopdl"] = minus(r["pair"], r["gemm"]), minus(r["pair_nopdl"], r["gemm"])
        r["cudnn_share"] = minus(r["cudnn_pair"], r["torch_gemm"])
        rows.append(r)
    if not any(r["pdl"] for r in rows):
        return
    fmt = lambda x: f"{x:.1f}" if x is not None else "n/a"
    ratio = lambda a, b: f"{a / b:.2f}" if a is not None and b else "n/a"
    print("\n### Dense decode against cuDNN SDPA: back to back with and without PDL, and between GEMMs\n")
    print("q_heads 32, kv_heads 8, head_dim 128, bf16; GPU time per call from replays of CUDA graphs of 16 calls.")
    print("Back to back with PDL is how the tables above time kvsift: each decode kernel is a programmatic")
    print("dependent of the previous call and may start during its tail. cuDNN through PyTorch has no such")
    print("overlap; without PDL kvsift has none either. Between GEMMs: each graph holds 16 (decode, GEMM) pairs,")
    print("the GEMM a projection y [batch, 4096] = x [batch, 4096] w [4096, 4096] in bf16 with w rotating over")
    print("more than L2 (kvsift: cuBLAS from C++; cuDNN: torch.matmul); the decode's share is the pair's time")
    print("minus its library's GEMM alone, timed the same way. The ratios use kvsift with PDL (its default);")
    print("there the decode may start before the GEMM ends only if cuBLAS's kernel signals early. The raw")
    print("figures below give the pair without PDL too.\n")
    print("| N | batch | cuDNN us | kvsift / cuDNN, back to back, PDL | back to back, no PDL | "
          "between GEMMs, decode's share | between GEMMs, whole pair |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['batch']} | {fmt(r['cudnn'])} | {ratio(r['pdl'], r['cudnn'])} | "
              f"{ratio(r['nopdl'], r['cudnn'])} | {ratio(r['share'], r['cudnn_share'])} | "
              f"{ratio(r['pair'], r['cudnn_pair'])} |")
    print("\nThe raw figures (us):\n")
    print("| N | batch | kvsift PDL | kvsift no PDL | cuDNN | cuBLAS GEMM alone | kvsift + GEMM (PDL) | "
          "kvsift + GEMM (no PDL) | kvsift's share | torch GEMM alone | cuDNN + GEMM | cuDNN's share | cuDNN pair timed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['batch']} | {fmt(r['pdl'])} | {fmt(r['nopdl'])} | {fmt(r['cudnn'])} | "
              f"{fmt(r['gemm'])} | {fmt(r['pair'])} | {fmt(r['pair_nopdl'])} | {fmt(r['share'])} | "
              f"{fmt(r['torch_gemm'])} | {fmt(r['cudnn_pair'])} | {fmt(r['cudnn_share'])} | "
              f"{r['mode'] if r['cudnn_pair'] is not None else 'n/a'} |")
    gemm_errors = [x for x in sdpa if x["backend"] == "gemm" and "graph_error" in x]
    for e in gemm_errors[:2]:
        print(f"\ntorch GEMM batch={e['batch']} could not be captured in a graph: {e['graph_error']}")


def hybrid(runs):
    rows = [(k, r) for k, r in runs.items() if k.startswith("BM_HybridDecode")]
    if not rows:
        return
    print("\n### Hybrid decode step (batch 1, window sink 4 + recent 1024 on the GPU, 2% of the rest on the CPU)\n")
    print("The window's GPU work is enqueued before the CPU part starts and runs during it; the serial tail")
    print("(step - CPU part) is the copy of the CPU partial to the device, the merge and the stream sync.\n")
    print("| N | K per kv head | step us | CPU part us | GPU window alone us | serial tail us |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        n = re.match(r"BM_HybridDecode/N:(\d+)", name)[1]
        print(f"| {n} | {r['K']:.0f} | {r['us']:.0f} | {r['cpu_us']:.0f} | {r['gpu_window_us']:.1f} | "
              f"{r['us'] - r['cpu_us']:.0f} |")


def split_sweep(runs):
    rows = [(k, r) for k, r in runs.items() if re.search(r"/splits:[1-9]\d*/pdl:1/warps:0(/|$)", k)]
    if not rows:
        return
    auto = {re.sub(r"/splits:0/pdl:1/warps:0(/.*)?$", "", k): r for k, r in runs.items()
            if re.search(r"/splits:0/pdl:1/warps:0(/|$)", k) and "/window:1" not in k}
    print("\n### Split count: forced num_splits against kvsift's own choice (GPU time per call, us)\n")
    print("| shape | splits | us | kvsift's choice us |")
    print("|---|---|---|---|")
    for name, r in rows:
        shape, splits = re.match(r"BM_(\w+/.*?)/splits:(\d+)", name).groups()
        chosen = auto.get("BM_" + shape)
        chosen_us = f"{chosen['us']:.1f}" if chosen else "n/a"
        print(f"| {shape} | {splits} | {r['us']:.1f} | {chosen_us} |")


def placement(runs):
    rows = [(k, r) for k, r in runs.items() if k.startswith("BM_DensePlacement")]
    if not rows:
        return
    print("\n### Placement: the same dense call on fresh allocations (GPU time per call, us)\n")
    print("| shape | instance | us |")
    print("|---|---|---|")
    for name, r in rows:
        n, batch, instance = re.match(r"BM_DensePlacement/N:(\d+)/batch:(\d+)/instance:(\d+)", name).groups()
        print(f"| N {n}, batch {batch} | {instance} | {r['us']:.1f} |")


def latency_model(runs):
    """The latency model of the decode step: per stage (BM_StepStage) and per step (BM_Step), the bytes it must move,
    their floor at the measured copy bandwidth, the time and how far above the floor it is, and its launches."""
    for bench, title in (("BM_StepStage", "Stages of the Quest and OracleTopK steps"), ("BM_Step", "Steps")):
        rows = [(k, r) for k, r in runs.items() if k.startswith(bench + "/") and r["floor_us"]]
        if not rows:
            continue
        print(f"\n### Latency model: {title} (GPU time per call from graph replays)\n")
        print("| what | shape | MB | floor us | us | x floor | launches |")
        print("|---|---|---|---|---|---|---|")
        for name, r in rows:
            shape = "/".join(p for p in name.split("/")[1:] if re.match(r"(N|batch|pdl|P|sort|alpha):", p))
            print(f"| {r['label']} | {shape} | {r['mb']:.2f} | {r['floor_us']:.2f} | {r['us']:.1f} | "
                  f"{r['x_floor']:.1f} | {r['launches']:.0f} |")


def comparison(runs, title, this, that, columns):
    """Benchmarks whose name holds `this` beside their twins with `that` in its place."""
    rows = [(k, r) for k, r in runs.items() if this in k and runs.get(k.replace(this, that))]
    if not rows:
        return
    print(f"\n### {title} (GPU time per call, us)\n")
    print(f"| shape | {columns[0]} us | {columns[1]} us | {columns[1]} / {columns[0]} |")
    print("|---|---|---|---|")
    for name, r in rows:
        twin = runs[name.replace(this, that)]
        shape = re.sub(r"/splits:\d+/pdl:.*$", "", name[3:])
        print(f"| {shape} | {r['us']:.1f} | {twin['us']:.1f} | {twin['us'] / r['us']:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:4])
    versus_cudnn(medians(sys.argv[1]), sys.argv[2])
    split_sweep(medians(sys.argv[1]))
    placement(medians(sys.argv[1]))
    comparison(medians(sys.argv[1]), "Programmatic dependent launch of the decode kernel: off against on",
               "/pdl:0/warps:0", "/pdl:1/warps:0", ("pdl off", "pdl on"))
    comparison(medians(sys.argv[1]), "Warps per CTA: four against kvsift's choice for this GPU",
               "/pdl:1/warps:4", "/pdl:1/warps:0", ("4 warps", "chosen"))
    comparison(medians(sys.argv[1]), "The attention window (sink 4 + recent 64) in the same launch as the K selected: "
               "without against with", "/window:0", "/window:1", ("no window", "window"))
    hybrid(medians(sys.argv[1]))
    latency_model(medians(sys.argv[1]))
