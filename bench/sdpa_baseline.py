"""PyTorch scaled_dot_product_attention decode baseline (flash and cuDNN backends) for the shapes of
bench_decode.cpp's BM_DenseDecode: q_heads 32, kv_heads 8, head_dim 128, bf16, one query token.
Prints JSON lines {backend, N, batch, us, graph_us, gqa_mode} over rotating KV copies, timed as kvsift is:
us is the median of CUDA-event timings of back-to-back eager calls (kvsift's eager_us), graph_us the GPU time
per call from replays of a CUDA graph of 16 calls (kvsift's manual time)."""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Q_HEADS, KV_HEADS, D = 32, 8, 128
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


def main():
    torch.manual_seed(0)
    for n in (8192, 32768, 131072):
        for batch in (1, 8):
            kv_bytes = 2 * batch * KV_HEADS * n * D * 2
            copies = max(1, -(-L2_FLUSH // kv_bytes))
            q = torch.randn(batch, Q_HEADS, 1, D, device="cuda", dtype=torch.bfloat16)
            ks = [torch.randn(batch, KV_HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            vs = [torch.randn(batch, KV_HEADS, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
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
                except Exception as e:  # noqa: BLE001 - report any backend refusal as data
                    result["error"] = str(e).splitlines()[0][:200]
                print(json.dumps(result), flush=True)
            del ks, vs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
