"""Shared fixtures of the Python package's tests: an fp64 attention reference written here (independent of
kvsift), random problems, and output poisoning."""
import numpy as np
import pytest

import kvsift


@pytest.fixture
def rng(request):
    # A fresh seed per test, printed on failure through the test id's hash.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (1 << 32))


def reference_attention(q, keys, values, sm_scale, log_weights=None):
    """fp64 softmax(sm_scale * q.k + w) . v over the given rows: q [d], keys/values [n, d]. (o, natural-log lse)."""
    if len(keys) == 0:
        return np.zeros(q.shape[-1]), -np.inf
    logits = sm_scale * (keys.astype(np.float64) @ q.astype(np.float64))
    if log_weights is not None:
        logits = logits + log_weights
    top = logits.max()
    p = np.exp(logits - top)
    return (p @ values.astype(np.float64)) / p.sum(), top + np.log(p.sum())


def attended_tokens(length, window, selected):
    """Sorted union of the window (sink, recent) and the selected tokens of a sequence of `length` tokens."""
    sink, recent = window
    tokens = set(range(min(sink, length))) | set(range(max(0, length - recent), length)) | set(int(t) for t in selected)
    return sorted(tokens)


def random_float16_cache(rng, lengths, kv_heads, capacity, head_dim):
    """A contiguous float16 cache of normal K and V [batch, kv_heads, capacity, head_dim] with `lengths`:
    (k, v, lengths as int32, the kvsift.KVCache over them)."""
    shape = (len(lengths), kv_heads, capacity, head_dim)
    k = rng.standard_normal(shape).astype(np.float16)
    v = rng.standard_normal(shape).astype(np.float16)
    lengths = np.array(lengths, dtype=np.int32)
    return k, v, lengths, kvsift.contiguous_cache(k, v, lengths)


def middle_selection(rng, lengths, window, capacity, kv_heads):
    """Random distinct middle tokens (outside the window) per (sequence, kv head), fewer than capacity in some rows,
    -7 past each count: (indices [batch, kv_heads, capacity], counts [batch, kv_heads]) int32."""
    batch = len(lengths)
    indices = np.full((batch, kv_heads, capacity), -7, dtype=np.int32)
    counts = np.zeros((batch, kv_heads), dtype=np.int32)
    for b, length in enumerate(lengths):
        middle = np.arange(window[0], length - window[1])
        for h in range(kv_heads):
            n = min(len(middle), int(rng.integers(0, capacity + 1)))
            indices[b, h, :n] = rng.choice(middle, n, replace=False)
            counts[b, h] = n
    return indices, counts


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)
