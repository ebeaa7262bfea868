"""PyTorch scaled_dot_product_attention decode baseline (flash and cuDNN backends) for the shapes of
bench_decode.cpp's BM_DenseDecode: q_heads 32, kv_heads 8, head_dim 128, bf16, one query token.
Prints JSON lines {backend, N, batch, us, graph_us, gqa_mode} over rotating KV copies, timed as kvsift is:
us is the median of CUDA-event timings of back-to-back eager calls (kvsift's eager_us), graph_us the GPU time
per call from replays of a CUDA graph of 16 calls (kvsift's manual time).

Interleaved, as bench_decode.cpp's BM_DenseInterleaved and BM_ProjectionGemm (cuDNN at N 32K and 128K): a
projection-sized GEMM, torch.matmul of x [batch, 4096] by w [4096, 4096] in bf16 with w rotating over copies
that exceed L2, after every SDPA call. Lines {"backend": "cudnn", "N", "batch", "pair_us", "pair_mode"} give
the time per (SDPA, GEMM) pair: from a CUDA graph of 16 pairs where it can be captured (pair_mode "graph"),
else eagerly ("eager": the median of event timings of back-to-back direct calls). {"backend": "gemm",
"batch", "graph_us", "eager_us"} is the GEMM alone, timed both ways, so that report.py subtracts the one
timed as the pair was."""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, D = 32, 8, 128
D_MODEL = 4096  # the projection GEMM's width
INTERLEAVED_N = (32768, 131072)
L2_FLUSH = 256 << 20
CALLS_PER_GRAPH = 16


def time_us(fn, reps=50):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    stop = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        fn(0)
    for i in range(reps):
        start[i].record()
        fn(i)
        stop[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(start, stop))
    return times[len(times) // 2]


def graph_time_us(fn, replays=20):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fn(i)
    graph.replay()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    stop = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for i in range(replays):
        start[i].record()
        graph.replay()
        stop[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 / CALLS_PER_GRAPH for s, e in zip(start, stop))
    return times[len(times) // 2]


def make_gemm(batch):
    """The projection GEMM of bench_decode.cpp's ProjectionGemm: a callable of the call number."""
    copies = max(1, -(-L2_FLUSH // (D_MODEL * D_MODEL * 2)))
    ws = [torch.randn(D_MODEL, D_MODEL, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(batch, D_MODEL, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(batch, D_MODEL, device="cuda", dtype=torch.bfloat16)

    def gemm(i):
        torch.matmul(x, ws[i % copies], out=y)
    return gemm


def graph_or_eager_us(fn):
    """GPU time per call from graph replays where fn can be captured, else eagerly; and which it was."""
    try:
        return graph_time_us(fn), "graph"
    except Exception:  # noqa: BLE001 - a kernel that cannot be captured: time it eagerly instead
        torch.cuda.synchronize()
        return time_us(fn), "eager"


def main():
    torch.manual_seed(0)
    # KVSIFT_SDPA_N, KVSIFT_SDPA_BATCHES and KVSIFT_SDPA_BACKENDS (comma-separated) narrow the run, e.g. to the
    # decode step's table.
    lengths = [int(x) for x in os.environ.get("KVSIFT_SDPA_N", "8192,32768,131072").split(",")]
    batches = [int(x) for x in os.environ.get("KVSIFT_SDPA_BATCHES", "1,8").split(",")]
    backends = os.environ.get("KVSIFT_SDPA_BACKENDS", "flash,cudnn").split(",")
    gemms = {}
    for batch in batches:
        gemms[batch] = make_gemm(batch)
        result = {"backend": "gemm", "batch": batch, "eager_us": time_us(gemms[batch])}
        try:
            result["graph_us"] = graph_time_us(gemms[batch])
        except Exception as e:  # noqa: BLE001 - report it; the eager figure stands in
            result["graph_error"] = str(e).splitlines()[0][:200]
        print(json.dumps(result), flush=True)
    for n in lengths:
        for batch in batches:
            kv_bytes = 2 * batch * KV_HEADS * n * D * 2
            copies = max(1, -(-L2_FLUSH // kv_bytes))
            q = torch.randn(batch, Q_HEADS, 1, D, device="cuda", dtype=torch.bfloat16)
            ks = [torch.randn(batch, KV_HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            vs = [torch.randn(batch, KV_HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                if name not in backends:
                    continue
                result = {"backend": name, "N": n, "batch": batch}
                try:
                    with sdpa_kernel(backend):
                        # GQA natively where the backend supports it; otherwise not measured (expanding K/V
                        # would move 4x the bytes and not be a fair baseline).
                        def run(i):
                            F.scaled_dot_product_attention(q, ks[i % copies], vs[i % copies], enable_gqa=True)
                        result["us"] = time_us(run)
                        result["gqa_mode"] = "enable_gqa"
                        try:
                            result["graph_us"] = graph_time_us(run)
                        except Exception as e:  # noqa: BLE001 - a backend that cannot be captured
                            result["graph_error"] = str(e).splitlines()[0][:200]
                        if name == "cudnn" and n in INTERLEAVED_N:
                            gemm = gemms[batch]

                            def pair(i):
                                run(i)
                                gemm(i)
                            result["pair_us"], result["pair_mode"] = graph_or_eager_us(pair)
                except Exception as e:  # noqa: BLE001 - report any backend refusal as data
                    result["error"] = str(e).splitlines()[0][:200]
                print(json.dumps(result), flush=True)
            del ks, vs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
