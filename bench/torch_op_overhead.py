"""What the torch op path costs over the package's direct call (issue 41's target: <= 2 us per call in a CUDA graph):
one layer's Quest decode step (q 32 / kv 8 heads, head_dim 128, bf16, budget 2048 + window (4, 64), batch 1) called
three ways on the same step, cache and query: DecodeStep.run with caller-given outputs (the nanobind call),
torch.ops.kvsift.decode_step_into (the custom op, caller-given outputs) and torch.ops.kvsift.decode_step (the
functional op, which allocates its outputs). Each is timed as graph replays (sdpa_baseline.py's graph_time_us: 16
calls a graph, the median of 20 replays) and eagerly (host wall time per call over 200 calls, the stream drained once
at the end). Prints one JSON line per (context, way) and a markdown table.

Usage (GPU machine, repository root, kvsift installed with CUDA; bench/run_device.sh python runs it):
  python3 bench/torch_op_overhead.py [--contexts 32768,131072]"""
import argparse
import json
import os
import sys
import time

import torch

import kvsift
import kvsift.torch_ops  # noqa: F401  (registers torch.ops.kvsift)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_baseline import graph_time_us  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BUDGET, WINDOW = 32, 8, 128, 2048, (4, 64)
EAGER_CALLS = 200


def eager_us(fn):
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(EAGER_CALLS):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / EAGER_CALLS


def measure(context):
    g = torch.Generator(device="cuda").manual_seed(context)
    k = torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=g, device="cuda").bfloat16()
    v = torch.randn(1, KV_HEADS, context, HEAD_DIM, generator=g, device="cuda").bfloat16()
    lengths = torch.full((1,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(1, Q_HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    o = torch.empty_like(q)
    lse = torch.empty(1, Q_HEADS, dtype=torch.float32, device="cuda")
    step = kvsift.DecodeStep("quest", {"budget": BUDGET, "page_size": 16}, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, max_seq_len=context, window=WINDOW, dtype="bfloat16", device="cuda")
    cache = kvsift.contiguous_cache(k, v, lengths)
    step.prepare(cache, slots)
    handle = kvsift.torch_ops.register_step(step)
    ways = {
        "DecodeStep.run": lambda i: step.run(q, cache, slots, o=o, lse=lse),
        "decode_step_into op": lambda i: torch.ops.kvsift.decode_step_into(handle, q, [k, v, lengths], "contiguous",
                                                                             slots, o, lse),
        "decode_step op": lambda i: torch.ops.kvsift.decode_step(handle, q, [k, v, lengths], "contiguous", slots,
                                                                   None),
    }
    rows = []
    try:
        for name, fn in ways.items():
            rows.append({"context": context, "way": name, "graph_us": graph_time_us(fn), "eager_us": eager_us(fn)})
    finally:
        kvsift.torch_ops.unregister_step(handle)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="32768,131072")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not kvsift.has_cuda:
        print("torch_op_overhead: needs a CUDA GPU and kvsift built with CUDA: skipped")
        return 0
    rows = [r for n in args.contexts.split(",") for r in measure(int(n))]
    for r in rows:
        print(json.dumps(r))
    print(f"\nQuest step (q {Q_HEADS} / kv {KV_HEADS} / d {HEAD_DIM}, bf16, budget {BUDGET} + window {WINDOW}, batch 1), "
          f"{torch.cuda.get_device_name()}: us per call\n")
    print("| context | way | graph replays | over DecodeStep.run | eager | over DecodeStep.run |")
    print("|---|---|---|---|---|---|")
    base = {r["context"]: r for r in rows if r["way"] == "DecodeStep.run"}
    for r in rows:
        b = base[r["context"]]
        print(f"| {r['context']} | {r['way']} | {r['graph_us']:.1f} | {r['graph_us'] - b['graph_us']:+.1f} | "
              f"{r['eager_us']:.1f} | {r['eager_us'] - b['eager_us']:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
