"""A whole model's decode step with kvsift's attention against torch SDPA (issue 41): a Llama-3.1-8B-shaped decoder
(32 layers, hidden 4096, 32 query / 8 kv heads, head_dim 128, RMSNorm, RoPE, a SwiGLU MLP of 14336, an LM head of
128256, bf16, random weights), one token per sequence and step, whose attention is torch SDPA (cuDNN or flash),
kvsift's dense decode or a kvsift selector's decode step (kvsift.torch_ops). The whole step (every layer's GEMMs,
norms, RoPE, cache write and attention, then the LM head) is captured in CUDA graphs of 16 steps and replayed
(sdpa_baseline.py's graph_time_us).

Per (attention, context, batch) it reports the step's GPU time (the median of graph replays), tokens/s, the speedup
over SDPA on the same shape, and the share of the step spent in attention (the step timed again with attention left
out). The caches hold random keys and values (prefill is not timed); each selector prepares its index over them.
`--capacity` adds the largest batch that fits at 128K on this GPU for dense attention and for the selectors that
free memory: computed from the model's weights and the bytes a sequence keeps (the whole KV cache, or CentroidKV's
store at ratio R: R of it), not allocated. `--plot` draws the step time against context, a line per attention and a
panel per batch, as SVG (gnuplot where installed, else matplotlib); `--from-json` reads the rows of an earlier
`--json` instead of running, to redraw the table and the plot anywhere (no GPU, no torch).

Usage (GPU machine, repository root, kvsift installed with CUDA; bench/run_device.sh python builds it):
  python3 bench/model_decode.py [--contexts 32768,131072,524288] [--batches 1,8,32] \\
      [--attention sdpa_cudnn,sdpa_flash,kvsift_dense,quest,quest_pages,oracle_topk,centroidkv] [--json model.json] \\
      [--markdown model.md] [--capacity] [--plot model.svg]
  python3 bench/model_decode.py --from-json model.json [--gpu NAME] [--markdown model.md] [--plot model.svg]
  python3 bench/model_decode.py --tiny       # a 2-layer model of 1024 tokens on the CPU: the wiring's self-check"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

try:  # --from-json redraws saved rows on a machine without torch
    import torch
    import torch.nn.functional as F

    import kvsift
    import kvsift.torch_ops  # noqa: F401  (registers torch.ops.kvsift)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sdpa_baseline import graph_time_us  # noqa: E402  (timed as the attention baselines are)
except ImportError:
    torch = None

LLAMA_8B = dict(layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256,
                rope_theta=500000.0)
TINY = dict(layers=2, hidden=256, q_heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000, rope_theta=10000.0)

# Each selector at its documented defaults, budget 2048 + window (4, 64) as BM_Step (docs/quest.md).
SELECTORS = {
    "quest": ("quest", {"budget": 2048, "page_size": 16}, (4, 64)),
    "quest_pages": ("quest", {"budget": 2048, "page_size": 16}, (4, 64)),
    "oracle_topk": ("oracle_topk", {"budget": 2048}, (4, 64)),
    "centroidkv": ("centroidkv", {"budget_ratio": 0.25}, (0, 0)),
}
# DecodeStep options beyond the selector's: Quest's pages attended directly (DecodeStepConfig::page_selections).
STEP_OPTIONS = {"quest_pages": {"page_selections": True}}
ATTENTIONS = ("sdpa_cudnn", "sdpa_flash", "sdpa_math", "kvsift_dense", *SELECTORS)


class Model:
    """Random bf16 weights of `shape`, a KV cache per layer [batch, kv_heads, context + 1, head_dim] with `context`
    random tokens, and the step's input x [batch, hidden]. The decode step writes position `context`."""

    def __init__(self, shape, batch, context, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        s = self.shape = shape
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        h, d = s["hidden"], s["head_dim"]

        def weight(rows, cols):
            return (torch.randn(rows, cols, generator=g, device=device, dtype=dtype) / math.sqrt(rows))
        self.layers = []
        for _ in range(s["layers"]):
            self.layers.append(dict(
                qkv=weight(h, (s["q_heads"] + 2 * s["kv_heads"]) * d), o=weight(s["q_heads"] * d, h),
                gate_up=weight(h, 2 * s["ffn"]), down=weight(s["ffn"], h),
                norm1=torch.ones(h, device=device, dtype=dtype), norm2=torch.ones(h, device=device, dtype=dtype)))
        self.lm_head = weight(h, s["vocab"])
        self.final_norm = torch.ones(h, device=device, dtype=dtype)
        self.x = torch.randn(batch, h, generator=g, device=device, dtype=dtype)
        cache_dtype = torch.bfloat16 if device == "cuda" else torch.float16  # kvsift's CPU storage: float16
        shape_kv = (batch, s["kv_heads"], context + 1, d)
        self.k = [torch.randn(shape_kv, generator=g, device=device, dtype=torch.float32).to(cache_dtype)
                  for _ in range(s["layers"])]
        self.v = [torch.randn(shape_kv, generator=g, device=device, dtype=torch.float32).to(cache_dtype)
                  for _ in range(s["layers"])]
        self.lengths = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
        self.position = torch.full((1,), context, dtype=torch.long, device=device)
        inv = 1.0 / (s["rope_theta"] ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        angle = context * inv
        self.cos, self.sin = torch.cos(angle), torch.sin(angle)
        self.context, self.batch, self.device, self.cache_dtype = context, batch, device, cache_dtype

    def rope(self, x):
        """RoPE (half-split pairs, as Llama) at the step's position, x [..., head_dim]."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1).to(x.dtype)

    def step(self, attend):
        """One decode step: returns the logits [batch, vocab]. attend(layer, q [batch, q_heads, head_dim]) -> o."""
        s, b = self.shape, self.batch
        qh, kvh, d = s["q_heads"], s["kv_heads"], s["head_dim"]
        x = self.x
        for i, w in enumerate(self.layers):
            y = F.rms_norm(x, (s["hidden"],), w["norm1"])
            qkv = y @ w["qkv"]
            q = self.rope(qkv[:, :qh * d].view(b, qh, d))
            k = self.rope(qkv[:, qh * d:(qh + kvh) * d].view(b, kvh, 1, d))
            v = qkv[:, (qh + kvh) * d:].view(b, kvh, 1, d)
            self.k[i].index_copy_(2, self.position, k.to(self.cache_dtype))  # the engine's cache write
            self.v[i].index_copy_(2, self.position, v.to(self.cache_dtype))
            o = attend(i, q.to(self.cache_dtype))
            x = x + o.reshape(b, qh * d).to(x.dtype) @ w["o"]
            y = F.rms_norm(x, (s["hidden"],), w["norm2"])
            gate, up = (y @ w["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["down"]
        return F.rms_norm(x, (s["hidden"],), self.final_norm) @ self.lm_head


def make_attention(name, model):
    """attend(layer, q) for `name`, and a cleanup; a selector's steps are prepared here (one per layer)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    s = model.shape
    if name.startswith("sdpa_"):
        backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                   "sdpa_math": SDPBackend.MATH}[name]

        def attend(i, q):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q.unsqueeze(2), model.k[i], model.v[i], enable_gqa=True)
            return o.squeeze(2)
        return attend, lambda: None
    if name == "kvsift_dense":
        def attend(i, q):
            return torch.ops.kvsift.dense_decode(q, [model.k[i], model.v[i], model.lengths], "contiguous", 0.0,
                                                 model.context + 1, None)[0]
        return attend, lambda: None
    selector, config, window = SELECTORS[name]
    handles = []
    for i in range(s["layers"]):
        step = kvsift.DecodeStep(selector, config, q_heads=s["q_heads"], kv_heads=s["kv_heads"],
                                 head_dim=s["head_dim"], max_seq_len=model.context + 1, max_batch=model.batch,
                                 window=window, dtype=str(model.cache_dtype).replace("torch.", ""),
                                 device=model.device, **STEP_OPTIONS.get(name, {}))
        model.lengths.fill_(model.context)  # the prompt, before the step's token
        step.prepare(kvsift.contiguous_cache(model.k[i], model.v[i], model.lengths))
        handles.append(kvsift.torch_ops.register_step(step))
    model.lengths.fill_(model.context + 1)
    slots = torch.arange(model.batch, dtype=torch.int32, device=model.device)

    def attend(i, q):
        return torch.ops.kvsift.decode_step(handles[i], q, [model.k[i], model.v[i], model.lengths], "contiguous",
                                            slots, None)[0]
    return attend, lambda: [kvsift.torch_ops.unregister_step(h) for h in handles]


def kv_bytes_per_sequence(shape, context, ratio=1.0):
    return 2 * shape["layers"] * shape["kv_heads"] * math.ceil(ratio * context) * shape["head_dim"] * 2


def weight_bytes(shape):
    s = shape
    per_layer = s["hidden"] * ((s["q_heads"] + 2 * s["kv_heads"]) * s["head_dim"] + 2 * s["ffn"]) + \
        s["q_heads"] * s["head_dim"] * s["hidden"] + s["ffn"] * s["hidden"]
    return 2 * (s["layers"] * per_layer + s["hidden"] * s["vocab"])


def run(args):
    shape, gpu = LLAMA_8B, torch.cuda.get_device_name()
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            need = weight_bytes(shape) + batch * kv_bytes_per_sequence(shape, context + 1)
            free = torch.cuda.mem_get_info()[0]
            if need > 0.9 * free:
                print(f"model_decode: {context} tokens x batch {batch} needs {need / 1e9:.0f} GB: skipped",
                      file=sys.stderr)
                continue
            model = Model(shape, batch, context, "cuda")
            none_us = graph_time_us(lambda _: model.step(lambda i, q: q))  # attention left out
            base_us = None
            for name in args.attention:
                try:
                    attend, cleanup = make_attention(name, model)
                except (RuntimeError, kvsift.Error) as e:
                    print(f"model_decode: {name} at {context} x {batch}: {e}", file=sys.stderr)
                    continue
                try:
                    us = graph_time_us(lambda _: model.step(attend))
                except RuntimeError as e:  # e.g. an SDPA backend that refuses the shape
                    print(f"model_decode: {name} at {context} x {batch}: {e}", file=sys.stderr)
                    continue
                finally:
                    cleanup()
                if name.startswith("sdpa_") and base_us is None:
                    base_us = us
                rows.append(dict(attention=name, context=context, batch=batch, step_us=us,
                                 tokens_per_s=batch / us * 1e6, attention_share=max(0.0, 1 - none_us / us),
                                 speedup_over_sdpa=(base_us / us) if base_us else None, no_attention_us=none_us,
                                 gpu=gpu))
                print(json.dumps(rows[-1]), flush=True)
            del model
            torch.cuda.empty_cache()
    return rows


def capacity(shape, context, gpu_bytes):
    """The largest batch whose weights and kept KV fit `gpu_bytes` (90% usable): dense, and CentroidKV's store."""
    usable = 0.9 * gpu_bytes - weight_bytes(shape)
    out = {"dense": int(usable // kv_bytes_per_sequence(shape, context))}
    ratio = SELECTORS["centroidkv"][1]["budget_ratio"]
    out["centroidkv"] = int(usable // kv_bytes_per_sequence(shape, context, ratio))
    return out


def markdown(rows, gpu):
    lines = [f"Whole-model decode step, Llama-3.1-8B shape, bf16, CUDA graph replays ({gpu}):", "",
             "| attention | context | batch | step µs | tokens/s | × SDPA | attention share |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        speedup = f"{r['speedup_over_sdpa']:.2f}" if r["speedup_over_sdpa"] else "—"
        lines.append(f"| {r['attention']} | {r['context']} | {r['batch']} | {r['step_us']:.0f} | "
                     f"{r['tokens_per_s']:.0f} | {speedup} | {100 * r['attention_share']:.0f}% |")
    return "\n".join(lines) + "\n"


def plot(rows, path, gpu):
    """An SVG at `path` of the step time (ms) against context, a line per attention (one colour in every panel), a
    panel per batch: gnuplot where installed, else matplotlib. Returns whether either drew it."""
    names = list(dict.fromkeys(r["attention"] for r in rows))  # the run's order
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    series = {(b, n): sorted((r["context"], r["step_us"] / 1e3) for r in rows
                             if (r["batch"], r["attention"]) == (b, n)) for b in batches for n in names}
    title = f"Whole-model decode step, Llama-3.1-8B shape, bf16 ({gpu})"
    ticks = [(f"{c // 1024}K", c) for c in contexts]
    if shutil.which("gnuplot"):
        script = [f"set terminal svg size {max(760, 620 * len(batches))},480 noenhanced font 'sans,12' background "
                  f"'white'", f"set output '{path}'", f"set multiplot layout 1,{len(batches)} title '{title}'",
                  "set logscale x", f"set xrange [{contexts[0] / 1.4}:{contexts[-1] * 1.4}]", "set yrange [0:*]",
                  "set xtics (" + ", ".join(f"'{label}' {c}" for label, c in ticks) + ")", "set grid",
                  "set xlabel 'context (tokens)'", "set ylabel 'ms per decode step'",
                  "set key outside right top Left reverse"]
        for b in batches:
            drawn = [n for n in names if series[b, n]]
            # Inline data (a datablock, a series per index): the plot needs no file beside the SVG.
            script.append(f"$batch{b} << EOD")
            script += [line for n in drawn for line in [f"{c} {ms}" for c, ms in series[b, n]] + ["", ""]]
            script += ["EOD", f"set title 'batch {b}'"]
            script.append("plot " + ", ".join(f"$batch{b} index {i} using 1:2 with linespoints lw 2 pt 7 "
                                              f"lt {names.index(n) + 1} title '{n}'" for i, n in enumerate(drawn)))
        script.append("unset multiplot")
        subprocess.run(["gnuplot"], input="\n".join(script) + "\n", text=True, check=True)
        return True
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("model_decode: --plot needs gnuplot or matplotlib, and neither is installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(batches), figsize=(max(7.6, 6.2 * len(batches)), 4.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for n in names:
            if series[b, n]:
                ax.plot(*zip(*series[b, n]), marker="o", label=n, color=f"C{names.index(n)}")
        ax.set(xscale="log", xlim=(contexts[0] / 1.4, contexts[-1] * 1.4), ylim=(0, None), title=f"batch {b}",
               xlabel="context (tokens)", ylabel="ms per decode step")
        ax.set_xticks([c for _, c in ticks], [label for label, _ in ticks])
        ax.minorticks_off()
        ax.grid(True)
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    return True


def tiny_self_check():
    """The CPU wiring check: a 2-layer model of 1024 tokens. What attention adds to the logits (the logits less those
    of the step with attention left out) with kvsift's dense decode, and with OracleTopK keeping every token, equals
    what SDPA (math backend) adds within fp16 rounding; OracleTopK keeping 16 tokens must differ (the check can
    fail)."""
    runs = {"sdpa_math": None, "kvsift_dense": None, "oracle_topk": ("oracle_topk", {"budget": 1025}, (0, 0)),
            "oracle_16": ("oracle_topk", {"budget": 16}, (0, 0))}
    logits = {}
    for name, selector in runs.items():
        model = Model(dict(TINY), 2, 1024, "cpu", seed=3)
        if name == "sdpa_math":
            logits["none"] = model.step(lambda i, q: torch.zeros_like(q)).float()
        saved = SELECTORS.get("oracle_topk")
        if selector is not None:
            SELECTORS["oracle_topk"] = selector
        try:
            attend, cleanup = make_attention("oracle_topk" if selector else name, model)
            logits[name] = model.step(attend).float()
            cleanup()
        finally:
            SELECTORS["oracle_topk"] = saved
    want = logits["sdpa_math"] - logits["none"]
    error = {name: ((logits[name] - logits["none"] - want).norm() / want.norm()).item() for name in runs}
    for name in ("kvsift_dense", "oracle_topk", "oracle_16"):
        print(f"model_decode --tiny: {name} vs SDPA: relative difference of attention's share of the logits "
              f"{error[name]:.1e}")
    for name in ("kvsift_dense", "oracle_topk"):
        if error[name] > 5e-3:
            raise SystemExit(f"model_decode --tiny: {name} differs from SDPA by {error[name]:.1e}")
    if error["oracle_16"] < 10 * max(error["kvsift_dense"], 1e-4):
        raise SystemExit(f"model_decode --tiny: 16 tokens of 1025 gave {error['oracle_16']:.1e}: the check cannot "
                         f"tell attention apart")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="32768,131072,524288", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--batches", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--attention", default="sdpa_cudnn,sdpa_flash,kvsift_dense,quest,quest_pages,oracle_topk,centroidkv",
                        type=lambda s: s.split(","))
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--capacity", action="store_true")
    parser.add_argument("--plot", metavar="PATH.svg")
    parser.add_argument("--from-json", metavar="FILE", help="the rows of an earlier --json instead of a run")
    parser.add_argument("--gpu", help="the GPU the --from-json rows ran on, where they do not say")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    if torch is None and not args.from_json:
        parser.error("needs torch and kvsift (--from-json redraws saved rows without them)")
    if args.tiny:
        return tiny_self_check()
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)
        if not rows:
            parser.error(f"--from-json: {args.from_json} holds no rows")
        gpu = args.gpu or rows[0].get("gpu") or "GPU not recorded"  # rows written before 'gpu' was a key lack it
    else:
        unknown = [a for a in args.attention if a not in ATTENTIONS]
        if unknown:
            parser.error(f"--attention: unknown {unknown} (known: {', '.join(ATTENTIONS)})")
        if not (torch.cuda.is_available() and kvsift.has_cuda):
            parser.error("needs a GPU and kvsift built with CUDA (--tiny runs on the CPU)")
        rows = run(args)
        gpu = torch.cuda.get_device_name()
    text = markdown(rows, gpu)
    if args.capacity and not args.from_json:
        total = torch.cuda.get_device_properties(0).total_memory
        fits = capacity(LLAMA_8B, 131072, total)
        text += (f"\nLargest batch at 128K on one {gpu} ({total / 1e9:.0f} GB; weights {weight_bytes(LLAMA_8B) / 1e9:.0f} "
                 f"GB; computed, not allocated): dense {fits['dense']}, CentroidKV at R 0.25 {fits['centroidkv']}\n")
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.plot and not plot(rows, args.plot, gpu):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
