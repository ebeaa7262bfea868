"""End-to-end quality of sparse decoding on SmolLM2-135M: every layer's decode attention goes through kvsift.

A text is prefilled densely (numpy, fp32) up to a point; the rest is decoded teacher-forced, each position
attending in every layer to what a kvsift selector picks (the kvsift Python package's CPU decode step, fp16
storage). Measured per selector and budget: perplexity of the decoded part, top-1 agreement of the next token
with dense decoding, and passkey retrieval (the key hidden mid-document, asked for at the end, answered greedily).

Decoding runs layer by layer over a block of new positions, each layer's decode step taking the block's tokens
one at a time in order: the same computation as token-by-token decoding (position t of layer l depends on
positions <= t of layer l - 1 only), with the projections and MLPs batched.

Budgets are middle tokens per (sequence, kv head), besides a window that every method attends (4 sinks + 16
recent tokens): StreamingLLM spends the budget on more recent tokens; CentroidKV's merge store holds budget + 20
entries (its own sinks and recent are the window's) and the step attends no window. A budget in percent is of the
context length of the measurement (4096 for the texts, the passkey length for passkeys).

"<selector>_rerank" (quest, csattention, a2ats_max): the selector proposes RERANK_FACTOR times the budget, the rerank
stage (selectors/rerank.hpp) keeps the budget's tokens of those proposals by their exact group softmax.

SpeContext (the layer-0 head): the model's layer-0 pre-RoPE q and k, which exist before the layers run, are the
retrieval head's q_r and k_r; one SpeContextStep serves all layers with one selection per position.
"specontext_groups": the layers in groups led by layers 0, 3 and 12 (SPECONTEXT_GROUPS: the three runs that keep the
most mass recall in docs/bench/specontext_layers_2pct.csv, tools/specontext/layer_groups.py), one SpeContextStep per
group whose head is the group's first layer's pre-RoPE q and k: three selections per position.
"specontext_rerank", "specontext_groups_rerank": the same steps selecting RERANK_FACTOR times the budget, each layer
keeping the budget's tokens of that selection by its own exact group softmax (SpeContextStep's rerank per layer).
"""
import argparse
import json
import sys
import time

import numpy as np

from capture import passkey_text
from model import Model

SINK, RECENT = 4, 16
SPECONTEXT_GROUPS = (0, 3, 12)  # "specontext_groups": the first layer of each group, its proxy
RERANK_FACTOR = 4  # "<selector>_rerank": the selector proposes this many times the tokens the rerank keeps


class Attention:
    """Hooks for a selector that selects once per position for a run of layers (SpeContext's retrieval head): every
    layer's prompt keys before RoPE, and each layer's block inputs before RoPE as the layer starts. The per-layer
    ones ignore them."""

    def prefill_head(self, k_pre_of_layer):
        pass

    def select_block(self, layer, q_pre, k_pre):
        pass


def contiguous_cache(kvsift, model, k, v, capacity):
    """A contiguous fp16 cache of `capacity` tokens holding k, v ([tokens, kv_heads, head_dim]): (the view, its
    lengths, the arrays). The view sees the arrays, and lengths[0] grows in place."""
    shape = (1, model.kv_heads, capacity, model.head_dim)
    cache_k, cache_v = np.zeros(shape, dtype=np.float16), np.zeros(shape, dtype=np.float16)
    cache_k[0, :, :len(k)] = k.transpose(1, 0, 2)
    cache_v[0, :, :len(v)] = v.transpose(1, 0, 2)
    lengths = np.array([len(k)], dtype=np.int32)
    return kvsift.contiguous_cache(cache_k, cache_v, lengths), lengths, (cache_k, cache_v)


class DenseAttention(Attention):
    """The fp32 numpy reference: every layer attends to its whole cache."""

    name = "dense (numpy fp32)"

    def __init__(self, model):
        self.model, self.k, self.v = model, {}, {}

    def prefill(self, layer, q, k, v):
        self.k[layer], self.v[layer] = k, v

    def decode(self, layer, q, k, v):
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        return self.model.attention(q, self.k[layer], self.v[layer])


class KvsiftAttention(Attention):
    """One kvsift DecodeStep per layer on the CPU, over a contiguous fp16 cache of `capacity` tokens."""

    def __init__(self, model, selector, budget, capacity, pool, codebooks=None):
        import kvsift
        self.kvsift, self.model, self.pool, self.codebooks = kvsift, model, pool, codebooks
        # "<selector>_rerank": the selector followed by the rerank stage (quest, csattention, a2ats_max)
        self.reranked = selector.endswith("_rerank")
        self.selector = selector.removesuffix("_rerank")
        if self.reranked and self.selector not in ("quest", "csattention", "a2ats_max"):
            raise SystemExit(f"--selectors {selector}: the rerank stage follows quest, csattention or a2ats_max")
        self.budget, self.capacity = budget, capacity
        self.layers = {}
        self.union_ratios = []  # ctkvr: each step's union of the recalled lists over rho * C', per kv head

    def _make_step(self, layer, prompt):
        m = self.model
        config, window = {"budget": self.budget}, (SINK, RECENT)
        if self.selector == "streaming_llm":
            config, window = {}, (SINK, RECENT + self.budget)
        elif self.selector == "centroidkv":
            # Equal memory: the store's B = floor(R * prompt) entries are the others' budget plus their window, and
            # its unmerged sinks and recent entries are that window (the paper's 16 + 64 would not fit B = 60 at
            # 1%); the step attends no window, the store holds those tokens. Between decode-time rounds the store
            # grows to B + interval (64: kvsift's default). + 0.5: floor(R * prompt) clear of fp32 rounding; at
            # most the whole prompt, as the others' selections.
            ratio = min(1.0, (self.budget + SINK + RECENT + 0.5) / prompt)
            config = {"budget_ratio": ratio, "sinks": SINK, "recent": RECENT}
            window = (0, 0)
        elif self.selector == "quest":
            config = {"budget": max(self.budget, 16), "page_size": 16}  # at least one page
        elif self.selector == "ctkvr":
            # The paper's C = N / 16, C' = 4, rho = 2.5 rho'; 512 centroid columns leave the dynamic update room
            # to grow before its FIFO wraps (the default 2048 would cost 31 MB of lists per layer at rho' = 512).
            config = {"budget": self.budget, "max_centroids": 512}
        elif self.selector == "csattention":
            config = {"budget": self.budget + SINK + RECENT}  # its budget counts the window
        elif self.selector in ("a2ats", "a2ats_max"):
            # Codebooks of another text (--a2ats-codebooks). a2ats: the authors' union of each query head's top K at
            # equal tokens, K = budget / g, so the union never exceeds the budget (fewer where the group's heads
            # agree); a2ats_max: the top `budget` of the group's maximum score, exactly the budget.
            if not self.codebooks:
                raise SystemExit(f"--selectors {self.selector} needs --a2ats-codebooks")
            group_max = self.selector == "a2ats_max"
            config = {"codebooks": self.codebooks, "layer": layer, "budget_fraction": 1.0, "group_max": int(group_max),
                      "max_budget": self.budget if group_max else max(1, self.budget // (m.q_heads // m.kv_heads)),
                      "rope_theta": m.rope_theta, "rope_dim": m.rope_dim, "rope_interleaved": 1}
        if self.reranked:  # the selector proposes RERANK_FACTOR times its selection, the rerank keeps the budget's
            kept = config.get("max_budget", config.get("budget"))
            proposed = min(RERANK_FACTOR * kept, self.capacity)
            if self.selector == "csattention":  # its budget counts the window; the rerank keeps the middle's share
                kept = self.budget
                proposed = min(RERANK_FACTOR * kept + SINK + RECENT, self.capacity)
            config = dict(config, rerank=kept, **{"max_budget" if "max_budget" in config else "budget": proposed})
        kind = "a2ats" if self.selector == "a2ats_max" else self.selector
        return self.kvsift.DecodeStep(kind, config, q_heads=m.q_heads, kv_heads=m.kv_heads,
                                      head_dim=m.head_dim, max_seq_len=self.capacity, window=window,
                                      dtype="float16", pool=self.pool)

    def prefill(self, layer, q, k, v):
        cache, lengths, arrays = contiguous_cache(self.kvsift, self.model, k, v, self.capacity)
        step = self._make_step(layer, len(k))
        slots = np.zeros(1, dtype=np.int32)
        queries = np.ascontiguousarray(q.transpose(1, 0, 2)[None], dtype=np.float16)  # [1, q_heads, W, d]
        step.prepare(cache, slots, queries=queries)
        self.layers[layer] = (step, cache, lengths, slots, arrays)

    def decode(self, layer, q, k, v):
        step, cache, lengths, slots, _ = self.layers[layer]
        m = self.model
        out = np.empty((len(q), m.q_heads, m.head_dim), dtype=np.float32)
        lse = np.empty((len(q), m.q_heads), dtype=np.float32)
        q16, k16, v16 = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
        for i in range(len(q)):
            lengths[0] += 1
            step.run(q16[i:i + 1], cache, slots, k=k16[i:i + 1], v=v16[i:i + 1], o=out[i:i + 1], lse=lse[i:i + 1])
            if self.selector == "ctkvr":  # the paper's deduplication coefficient (its rho = 2.5 rho', C' = 4)
                self.union_ratios.extend(step.union_sizes()[0] / (5 * self.budget // 2 * 4))
        return out


class SpeContextAttention(Attention):
    """SpeContext: per group of layers [firsts[g], firsts[g + 1]) one kvsift SpeContextStep (B = the budget, window
    4 + 16, the head's RoPE the model's) whose head is the group's first layer's pre-RoPE q and k; firsts (0,) is
    the layer-0 head serving every layer. Contiguous fp16 caches of `capacity` tokens per layer.

    The blocks run layer-major, and a group's head inputs of a whole block exist when its first layer starts, so
    select_block makes every position's selection for the group first, each seeing the head's keys up to its
    position only (the head's own lengths), and keeps them; each layer of the group then attends position i with
    selection i. The same selections and arithmetic as token-major decoding."""

    def __init__(self, model, budget, capacity, pool, firsts=(0,), reranked=False):
        import kvsift
        m = model
        self.kvsift, self.model, self.capacity, self.firsts = kvsift, model, capacity, tuple(firsts)
        ends = self.firsts[1:] + (m.layers,)
        # reranked: the head selects RERANK_FACTOR x the budget, each layer keeps the budget's best by its own scores
        proposed = min(RERANK_FACTOR * budget, capacity) if reranked else budget
        self.steps = [kvsift.SpeContextStep(layers=end - first, q_heads=m.q_heads, kv_heads=m.kv_heads,
                                            head_dim=m.head_dim, max_seq_len=capacity, rope_theta=m.rope_theta,
                                            rope_dim=m.rope_dim, rope_interleaved=True, budget=proposed,
                                            window=(SINK, RECENT), pool=pool, rerank=budget if reranked else 0)
                      for first, end in zip(self.firsts, ends)]
        self.group_of = [max(g for g, first in enumerate(self.firsts) if first <= layer) for layer in range(m.layers)]
        self.slots = np.zeros(1, dtype=np.int32)
        self.layers, self.selections = {}, [[] for _ in self.firsts]

    def prefill(self, layer, q, k, v):
        self.layers[layer] = contiguous_cache(self.kvsift, self.model, k, v, self.capacity)

    def prefill_head(self, k_pre_of_layer):
        # A head reads a cache only for its lengths: its first layer's arrays with lengths of the head's own, which
        # run ahead of the layers' during a block.
        self.head_lengths, self.head_caches = [], []
        for step, first in zip(self.steps, self.firsts):
            cache_k, cache_v = self.layers[first][2]
            lengths = np.array([len(k_pre_of_layer[first])], dtype=np.int32)
            cache = self.kvsift.contiguous_cache(cache_k, cache_v, lengths)
            keys = np.ascontiguousarray(k_pre_of_layer[first].transpose(1, 0, 2)[None], dtype=np.float16)
            step.prepare(cache, keys, self.slots)  # keys: [1, kv_heads, n, d]
            self.head_lengths.append(lengths)
            self.head_caches.append(cache)

    def select_block(self, layer, q_pre, k_pre):
        if layer not in self.firsts:
            return
        g = self.firsts.index(layer)
        q16, k16 = q_pre.astype(np.float16), k_pre.astype(np.float16)
        self.selections[g] = []
        for i in range(len(q16)):
            self.head_lengths[g][0] += 1
            self.steps[g].select(q16[i:i + 1], k16[i:i + 1], self.head_caches[g], self.slots)
            self.selections[g].append(self.steps[g].selection(1))

    def decode(self, layer, q, k, v):
        cache, lengths, _ = self.layers[layer]
        m, g = self.model, self.group_of[layer]
        out = np.empty((len(q), m.q_heads, m.head_dim), dtype=np.float32)
        lse = np.empty((len(q), m.q_heads), dtype=np.float32)
        q16, k16, v16 = q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)
        for i in range(len(q)):
            lengths[0] += 1
            self.steps[g].attend(layer - self.firsts[g], q16[i:i + 1], cache, k=k16[i:i + 1], v=v16[i:i + 1],
                                 o=out[i:i + 1], lse=lse[i:i + 1], selection=self.selections[g][i])
        return out


def make_attention(model, selector, budget, capacity, pool, codebooks):
    if selector in ("specontext", "specontext_rerank"):
        return SpeContextAttention(model, budget, capacity, pool, reranked=selector.endswith("_rerank"))
    if selector in ("specontext_groups", "specontext_groups_rerank"):
        return SpeContextAttention(model, budget, capacity, pool, SPECONTEXT_GROUPS, selector.endswith("_rerank"))
    return KvsiftAttention(model, selector, budget, capacity, pool, codebooks)


class Prefill:
    """The dense prefill of ids, shared by every configuration: each layer's K and V, and the last logits."""

    def __init__(self, model, ids):
        self.ids = list(ids)
        logits, captured = model.forward(self.ids, capture_layers=range(model.layers))
        self.qkv = [(captured[l]["q"].astype(np.float16), captured[l]["k"], captured[l]["v"]) for l in range(model.layers)]
        self.head_k = [captured[l]["k_pre"] for l in range(model.layers)]  # SpeContext's heads
        self.last_logits = logits[-1]


def decode_block(model, attention, ids, start):
    """Logits [len(ids), vocab] of ids at positions start.. through every layer, attention by `attention`."""
    x = model.embed(ids)
    positions = np.arange(start, start + len(ids))
    for layer in range(model.layers):
        q_pre, q, k_pre, k, v = model.qkv(layer, x, positions)
        attention.select_block(layer, q_pre, k_pre)
        x = model.finish_layer(layer, x, attention.decode(layer, q, k, v))
    return model.logits(x)


def start_decoding(model, attention, prefill):
    for layer, (q, k, v) in enumerate(prefill.qkv):
        attention.prefill(layer, q, k, v)
    attention.prefill_head(prefill.head_k)


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def text_quality(model, attention, prefill, ids):
    """Teacher-forced decoding of ids after the prefill: (logits of every decoded position, its perplexity)."""
    start_decoding(model, attention, prefill)
    logits = decode_block(model, attention, ids, len(prefill.ids))
    nll = -log_softmax(logits[:-1])[np.arange(len(ids) - 1), ids[1:]]
    return logits, float(np.exp(nll.mean()))


def passkey_answer(model, attention, prefill, ids, answer_tokens=6):
    """Teacher-forced decoding of ids (the end of the document and the question), then a greedy answer."""
    start_decoding(model, attention, prefill)
    logits = decode_block(model, attention, ids, len(prefill.ids))
    answer = [int(np.argmax(logits[-1]))]
    for _ in range(answer_tokens - 1):
        answer.append(int(np.argmax(decode_block(model, attention, [answer[-1]], len(prefill.ids) + len(ids) + len(answer) - 1)[-1])))
    return model.tokenizer.decode(answer)


def budgets_for(length, args):
    fixed = [int(b) for b in args.fixed.split(",") if b]
    percents = [float(p) for p in args.percents.split(",") if p]
    return [(f"{p:g}%", max(1, int(p / 100 * length))) for p in percents] + [(str(b), b) for b in fixed]


def markdown(results, selectors):
    lines = []
    for text in results["texts"]:
        lines += [f"**{text['text']}**, {text['tokens']} tokens, the first {text['prefill']} prefilled densely: "
                  "perplexity of the decoded part and top-1 agreement with dense decoding (numpy fp32).", "",
                  "| method | budget (middle tokens) | perplexity | top-1 agreement |", "|---|---|---|---|"]
        for row in text["rows"]:
            budget = row["budget"] if "tokens" not in row or row["budget"] == "all" else f"{row['budget']} ({row['tokens']})"
            lines.append(f"| {row['method']} | {budget} | {row['ppl']:.3f} | {row['top1']:.4f} |")
        lines.append("")
    if results["passkeys"]:
        names = list(results["passkeys"][0]["answers"])
        keys = results["passkeys"]
        lines += [f"**Passkeys** ({keys[0]['tokens']} tokens, the key mid-document, the question at the end; the last "
                  "tokens of the prompt decoded sparsely, then a greedy answer): keys found.", "",
                  "| method | " + " | ".join(str(k["key"]) for k in keys) + " | found |",
                  "|---|" + "---|" * (len(keys) + 1)]
        for name in names:
            found = [k["answers"][name]["found"] for k in keys]
            lines.append(f"| {name} | " + " | ".join("yes" if f else "no" for f in found) + f" | {sum(found)}/{len(found)} |")
        lines.append("")
    return "\n".join(lines)


def plot_data(results, selectors):
    """Per text a block: budget in tokens, then per selector perplexity and top-1 agreement; dense on comments."""
    out = []
    for text in results["texts"]:
        dense = next(r for r in text["rows"] if r["method"] == "dense (numpy fp32)")
        out.append(f"# panel {text['text'].rsplit('/', 1)[-1]} dense_ppl {dense['ppl']:.4f}")
        out.append("budget " + " ".join(f"{s}_ppl {s}_top1" for s in selectors))
        budgets = sorted({r["tokens"] for r in text["rows"] if r["method"] in selectors})
        for b in budgets:
            cells = []
            for s in selectors:
                row = next((r for r in text["rows"] if r["method"] == s and r["tokens"] == b), None)
                cells += [f"{row['ppl']:.4f}", f"{row['top1']:.4f}"] if row else ["NaN", "NaN"]
            out.append(f"{b} " + " ".join(cells))
        out += ["", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="/usr/share/common-licenses/GPL-3,/usr/share/common-licenses/MPL-1.1")
    parser.add_argument("--tokens", type=int, default=4096, help="text length (prefill + decoded)")
    parser.add_argument("--prefill", type=int, default=3072, help="densely prefilled tokens of each text")
    parser.add_argument("--selectors", default="oracle_topk,streaming_llm,quest")
    parser.add_argument("--percents", default="1,2,5")
    parser.add_argument("--fixed", default="256,512")
    parser.add_argument("--passkeys", default="68413,29107,51736,90254", help="one passkey run per key")
    parser.add_argument("--passkey-tokens", type=int, default=2048)
    parser.add_argument("--passkey-decoded", type=int, default=32,
                        help="tokens before the end of the passkey prompt decoded sparsely (the question is ~10)")
    parser.add_argument("--a2ats-codebooks", help="A²ATS's codebook file (kvsift_a2ats_codebook), for --selectors a2ats")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the tables here (docs/e2e.md's results)")
    parser.add_argument("--plot-data", help="write gnuplot data here (tools/e2e_plot.gp)")
    args = parser.parse_args()

    import kvsift
    pool = kvsift.ThreadPool(args.threads)
    model = Model()
    selectors = [s for s in args.selectors.split(",") if s]
    results = {"texts": [], "passkeys": []}

    for path in [p for p in args.texts.split(",") if p]:
        ids = model.tokenizer.encode(open(path, encoding="utf-8").read())[:args.tokens]
        if len(ids) < args.tokens:
            raise SystemExit(f"{path} has {len(ids)} tokens, fewer than --tokens {args.tokens}")
        began = time.time()
        prefill = Prefill(model, ids[:args.prefill])
        decoded = ids[args.prefill:]
        dense_logits, dense_ppl = text_quality(model, DenseAttention(model), prefill, decoded)
        dense_top1 = dense_logits[:-1].argmax(axis=-1)
        rows = [{"method": "dense (numpy fp32)", "budget": "all", "ppl": dense_ppl, "top1": 1.0}]
        print(f"{path}: {len(ids)} tokens, prefill {args.prefill}; dense ppl {dense_ppl:.3f} ({time.time() - began:.0f} s)",
              flush=True)
        configs = [("oracle_topk", "all", args.tokens)] + [
            (s, label, b) for s in selectors for label, b in budgets_for(args.tokens, args)]
        for selector, label, budget in configs:
            began = time.time()
            attention = make_attention(model, selector, budget, args.tokens, pool, args.a2ats_codebooks)
            logits, ppl = text_quality(model, attention, prefill, decoded)
            top1 = float(np.mean(logits[:-1].argmax(axis=-1) == dense_top1))
            name = "dense (kvsift fp16)" if label == "all" else selector
            rows.append({"method": name, "budget": label, "tokens": budget, "ppl": ppl, "top1": top1})
            union = ""
            if getattr(attention, "union_ratios", None):  # ctkvr's
                ratios = np.array(attention.union_ratios)
                rows[-1]["union_over_rho_c"] = {"mean": float(ratios.mean()), "p10": float(np.percentile(ratios, 10)),
                                                "p90": float(np.percentile(ratios, 90))}
                union = f"  union / (rho C') {ratios.mean():.3f} (p10 {np.percentile(ratios, 10):.3f}, " \
                        f"p90 {np.percentile(ratios, 90):.3f})"
            print(f"  {name:<20} {label:>5}: ppl {ppl:8.3f}  top-1 agreement {top1:.4f}{union}  "
                  f"({time.time() - began:.0f} s)", flush=True)
        results["texts"].append({"text": path, "tokens": args.tokens, "prefill": args.prefill, "rows": rows})

    text = open(args.texts.split(",")[0], encoding="utf-8").read()
    for key in [int(k) for k in args.passkeys.split(",") if k]:
        ids = model.tokenizer.encode(passkey_text(text, model.tokenizer, args.passkey_tokens, key))
        prefill = Prefill(model, ids[:-args.passkey_decoded])
        rest = ids[-args.passkey_decoded:]
        entry = {"key": key, "tokens": len(ids), "answers": {}}
        answer = passkey_answer(model, DenseAttention(model), prefill, rest)
        entry["answers"]["dense (numpy fp32)"] = {"answer": answer, "found": str(key) in answer}
        for selector in selectors:
            for label, budget in budgets_for(len(ids), args):
                attention = make_attention(model, selector, budget, len(ids) + 8, pool, args.a2ats_codebooks)
                answer = passkey_answer(model, attention, prefill, rest)
                entry["answers"][f"{selector} {label}"] = {"answer": answer, "found": str(key) in answer}
        print(f"passkey {key} ({len(ids)} tokens): " + ", ".join(
            f"{name} {'yes' if a['found'] else 'no'}" for name, a in entry["answers"].items()), flush=True)
        results["passkeys"].append(entry)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, selectors))
    if args.plot_data:
        with open(args.plot_data, "w") as f:
            f.write(plot_data(results, selectors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
