"""CentroidKV's decode step and SpeContext's model-level step through the Python package (numpy, CPU), against
fp64 numpy references written here."""
import numpy as np
import pytest

import kvsift
from conftest import attended_tokens, poisoned, random_float16_cache, reference_attention

Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 6, 2, 64, 512
GROUP = Q_HEADS // KV_HEADS
SCALE = 1 / np.sqrt(HEAD_DIM)


def random_cache(rng, lengths, kv_heads=KV_HEADS):
    return random_float16_cache(rng, lengths, kv_heads, CAPACITY, HEAD_DIM)


def heads(rng, batch, count):
    return rng.standard_normal((batch, count, HEAD_DIM)).astype(np.float16)


def expect_attention(o, lse, q, k, v, lengths, tokens_of, atol=2e-3):
    """o, lse of every (b, h) against fp64 attention of q[b, h] over tokens_of(b, g) of the cache."""
    for b in range(len(lengths)):
        for h in range(Q_HEADS):
            g = h // GROUP
            tokens = tokens_of(b, g)
            ref_o, ref_lse = reference_attention(q[b, h], k[b, g, tokens], v[b, g, tokens], SCALE)
            np.testing.assert_allclose(o[b, h], ref_o, atol=atol, rtol=0, err_msg=f"row ({b}, {h})")
            np.testing.assert_allclose(lse[b, h], ref_lse, atol=1e-4, rtol=1e-5, err_msg=f"row ({b}, {h})")


# ---- CentroidKV ----------------------------------------------------------------------------------------------

def centroidkv_step(config, pool=None, window=(0, 0)):
    return kvsift.DecodeStep("centroidkv", config, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_seq_len=CAPACITY, max_batch=2, max_slots=3, window=window, pool=pool)


def decode(rng, step, cache, k, v, lengths, slots):
    """One decode step with a fresh token: (q, o, lse), the outputs poisoned before the run."""
    lengths += 1
    q = heads(rng, len(lengths), Q_HEADS)
    new_k, new_v = heads(rng, len(lengths), KV_HEADS), heads(rng, len(lengths), KV_HEADS)
    o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
    step.run(q, cache, slots, k=new_k, v=new_v, o=o, lse=lse)
    for b in range(len(lengths)):
        np.testing.assert_array_equal(k[b, :, lengths[b] - 1], new_k[b])
    return q, o, lse


def test_centroidkv_without_a_merge_is_dense(rng):
    # R = 1: the budget is the prompt, so prefill merges nothing; fewer than `interval` steps merge nothing either.
    k, v, lengths, cache = random_cache(rng, [300, 451])
    step = centroidkv_step({"budget_ratio": 1.0}, kvsift.ThreadPool(2))
    assert step.capacity == 0  # every entry is the store's, attended whole
    slots = np.array([2, 0], dtype=np.int32)
    step.prepare(cache, slots)
    for _ in range(3):
        q, o, lse = decode(rng, step, cache, k, v, lengths, slots)
        expect_attention(o, lse, q, k, v, lengths, lambda b, g: np.arange(lengths[b]))
        np.testing.assert_array_equal(step.store_sizes()[slots], np.repeat(lengths[:, None], KV_HEADS, 1))


def test_centroidkv_merging_identical_keys_is_dense(rng):
    # Equation 3 is exact when merged keys are equal: a middle of one key per head merges only equal keys, and
    # the degree-weighted values with log-degree logits reproduce dense attention whatever the values.
    k, v, lengths, cache = random_cache(rng, [400])
    sinks, recent = 16, 64
    k[0, :, sinks:lengths[0] - recent] = k[0, :, sinks:sinks + 1]
    step = centroidkv_step({"budget_ratio": 0.5, "sinks": sinks, "recent": recent})
    slots = np.array([1], dtype=np.int32)
    step.prepare(cache, slots)
    np.testing.assert_array_equal(step.store_sizes()[1], [200] * KV_HEADS)
    q, o, lse = decode(rng, step, cache, k, v, lengths, slots)
    # log(degree) is rounded to fp32 and the merged values to fp16: looser than the unmerged rows' bound.
    expect_attention(o, lse, q, k, v, lengths, lambda b, g: np.arange(lengths[b]), atol=4e-3)


def test_centroidkv_store_stays_within_its_budget(rng):
    k, v, lengths, cache = random_cache(rng, [400, 333])
    interval = 16
    step = centroidkv_step({"budget_ratio": 0.5, "interval": interval, "sinks": 4, "recent": 16})
    slots = np.array([0, 2], dtype=np.int32)
    step.prepare(cache, slots)
    budgets = lengths // 2
    np.testing.assert_array_equal(step.store_sizes()[slots], np.repeat(budgets[:, None], KV_HEADS, 1))
    seen_round = False
    for _ in range(2 * interval + 3):
        q, o, lse = decode(rng, step, cache, k, v, lengths, slots)
        sizes = step.store_sizes()[slots]
        assert (sizes > budgets[:, None]).all() and (sizes <= budgets[:, None] + interval).all(), sizes
        seen_round |= bool((sizes == budgets[:, None] + 1).all())
        assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert seen_round  # a decode-time round brought the store back to B before the token joined


def test_centroidkv_refusals(rng):
    k, v, lengths, cache = random_cache(rng, [300])
    with pytest.raises(kvsift.Error, match="does not take"):
        centroidkv_step({"budget_ratio": 0.5, "budget": 10})
    with pytest.raises(kvsift.Error, match="budget_ratio"):
        centroidkv_step({"budget_ratio": 1.5})
    with pytest.raises(kvsift.Error, match="window"):
        centroidkv_step({"budget_ratio": 0.5}, window=(4, 16)).prepare(cache)
    with pytest.raises(kvsift.Error, match="cannot meet it"):  # B = 60 <= sinks + recent = 80
        centroidkv_step({"budget_ratio": 0.2}).prepare(cache)
    with pytest.raises(kvsift.Error, match="keeps no store"):
        kvsift.DecodeStep("streaming_llm", {}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          max_seq_len=CAPACITY).store_sizes()


# ---- SpeContext ----------------------------------------------------------------------------------------------

THETA = 1e5


def inv_freq(rotary, yarn=None):
    """THETA^(-2i / rotary); with yarn = (factor, original length), HF's YaRN (beta_fast 32, beta_slow 1, the
    correction range floored and ceiled): f / factor on the low frequencies, f on the high, a linear ramp between."""
    f = THETA ** (-2.0 * np.arange(rotary // 2) / rotary)
    if yarn is None:
        return f
    factor, original = yarn
    corr = lambda rotations: rotary * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(THETA))
    low, high = max(np.floor(corr(32.0)), 0.0), min(np.ceil(corr(1.0)), rotary - 1.0)
    high += 0.001 if low == high else 0.0
    ramp = np.clip((np.arange(rotary // 2) - low) / (high - low), 0.0, 1.0)
    return f / factor * ramp + f * (1 - ramp)


def rope(x, positions, rotary=HEAD_DIM, yarn=None):
    """Interleaved pairs (2i, 2i+1) rotated by positions * inv_freq, fp64, times YaRN's attention factor
    0.1 ln(factor) + 1 (q and k both carry it), rounded to fp16 as kvsift stores them. x [..., tokens, head_dim],
    positions [tokens]."""
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq(rotary, yarn)[None, :]
    scale = 1.0 if yarn is None else 0.1 * np.log(yarn[0]) + 1.0
    cos, sin = scale * np.cos(angle), scale * np.sin(angle)
    out = x.astype(np.float64).copy()
    a, b = out[..., 0:rotary:2].copy(), out[..., 1:rotary:2].copy()
    out[..., 0:rotary:2] = a * cos - b * sin
    out[..., 1:rotary:2] = a * sin + b * cos
    return out.astype(np.float16)


def expect_head_selection(indices, counts, q_r, head_k, lengths, budget, window, yarn=None):
    """Brute force: each query head's softmax over all of the sequence's tokens, the group's max, the top `budget`
    of the middle (outside the window). Near-ties (fp32 against fp64 scores) may swap."""
    sink, recent = window
    for b in range(len(lengths)):
        n = lengths[b]
        q = rope(q_r[b][:, None, :], [n - 1], yarn=yarn)[:, 0].astype(np.float64)  # [q_heads, d], the step's position
        keys = rope(head_k[b, :, :n], np.arange(n), yarn=yarn).astype(np.float64)  # [kv_heads, n, d]
        middle = np.arange(sink, max(sink, n - recent))
        for g in range(KV_HEADS):
            logits = SCALE * q[g * GROUP:(g + 1) * GROUP] @ keys[g].T
            weights = np.exp(logits - logits.max(-1, keepdims=True))
            score = (weights / weights.sum(-1, keepdims=True)).max(0)[middle]
            want = min(budget, len(middle))
            got = np.sort(indices[b, g, :counts[b, g]])
            assert counts[b, g] == want and len(set(got.tolist())) == want
            assert ((got >= sink) & (got < n - recent)).all()
            kth = np.sort(score)[::-1][want - 1]
            got_scores = score[got - sink]
            assert got_scores.min() >= kth * (1 - 1e-3) - 1e-9, (b, g)
            expected = middle[np.argsort(-score, kind="stable")[:want]]
            swapped = np.setxor1d(got, expected)
            assert np.all(np.abs(score[swapped - sink] - kth) <= 1e-3 * kth + 1e-9), (b, g, swapped)


@pytest.mark.parametrize("window", [(0, 0), (4, 16)])
def test_specontext_selects_the_head_top_and_every_layer_attends_it(rng, window):
    layers, budget, prompt = 3, 40, [300, 451]
    pool = kvsift.ThreadPool(2)
    step = kvsift.SpeContextStep(layers=layers, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 max_seq_len=CAPACITY, rope_theta=THETA, rope_interleaved=True, budget=budget,
                                 window=window, max_batch=2, max_slots=3, pool=pool)
    effective = (window[0], max(window[1], 1))
    assert step.capacity == budget and tuple(step.window) == effective
    caches = [random_cache(rng, prompt) for _ in range(layers)]
    head_k = rng.standard_normal((2, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float16)  # pre-RoPE, by position
    slots = np.array([2, 0], dtype=np.int32)
    step.prepare(caches[0][3], head_k, slots)
    kept = None
    for _ in range(3):
        for _, _, lengths, _ in caches:
            lengths += 1
        lengths = caches[0][2]
        q_r = heads(rng, 2, Q_HEADS)
        for b in range(2):
            head_k[b, :, lengths[b] - 1] = heads(rng, 1, KV_HEADS)[0]
        step.select(q_r, np.ascontiguousarray(head_k[np.arange(2), :, lengths - 1]), caches[0][3], slots)
        indices, counts = step.selection(2)
        expect_head_selection(indices, counts, q_r, head_k, lengths, budget, effective)
        for layer, (k, v, lengths, cache) in enumerate(caches):
            q = heads(rng, 2, Q_HEADS)
            new_k, new_v = heads(rng, 2, KV_HEADS), heads(rng, 2, KV_HEADS)
            o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
            step.attend(layer, q, cache, k=new_k, v=new_v, o=o, lse=lse)
            for b in range(2):
                np.testing.assert_array_equal(k[b, :, lengths[b] - 1], new_k[b])
                np.testing.assert_array_equal(v[b, :, lengths[b] - 1], new_v[b])
            expect_attention(o, lse, q, k, v, lengths,
                             lambda b, g: attended_tokens(lengths[b], effective, indices[b, g, :counts[b, g]]))
            if kept is not None:  # an earlier step's selection, given back: attended with the same window
                o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
                step.attend(layer, q, cache, o=o, lse=lse, selection=kept)
                expect_attention(o, lse, q, k, v, lengths,
                                 lambda b, g: attended_tokens(lengths[b], effective, kept[0][b, g, :kept[1][b, g]]))
        kept = (indices, counts)


def test_specontext_rerank_per_layer_attends_each_layers_best_of_the_selection(rng):
    # rerank=K over a head selection of 4 K: each layer attends the K candidates with the largest exact score (the
    # group's softmax weight over the candidates, max over the group; fp64 here), with a given selection alike.
    layers, kept, window = 2, 10, (4, 16)
    step = kvsift.SpeContextStep(layers=layers, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 max_seq_len=CAPACITY, rope_theta=THETA, rope_interleaved=True, budget=4 * kept,
                                 window=window, max_batch=2, rerank=kept)
    caches = [random_cache(rng, [300, 451]) for _ in range(layers)]
    head_k = rng.standard_normal((2, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float16)
    step.prepare(caches[0][3], head_k)
    for _, _, lengths, _ in caches:
        lengths += 1
    lengths = caches[0][2]
    step.select(heads(rng, 2, Q_HEADS), np.ascontiguousarray(head_k[np.arange(2), :, lengths - 1]), caches[0][3])
    indices, counts = step.selection(2)

    def ranked(q, k, b, g):
        """The candidates of row (b, g) by descending fp64 score, and the gap between the k-th and the next."""
        candidates = indices[b, g, :counts[b, g]]
        logits = np.einsum("hd,td->ht", q[b, g * GROUP:(g + 1) * GROUP].astype(np.float64),
                           k[b, g, candidates].astype(np.float64)) * SCALE
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        score = (weights / weights.sum(axis=1, keepdims=True)).max(axis=0)
        order = np.argsort(-score, kind="stable")
        return candidates[order], score[order[kept - 1]] - score[order[kept]]

    for layer, (k, v, lengths, cache) in enumerate(caches):
        for _ in range(20):  # a query with no near-tie at any row's k-th candidate (fp32 against fp64 could swap it)
            q = heads(rng, 2, Q_HEADS)
            if all(ranked(q, k, b, g)[1] > 1e-5 for b in range(2) for g in range(KV_HEADS)):
                break
        else:
            raise AssertionError("every query drawn had a near-tie")
        o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
        step.attend(layer, q, cache, k=heads(rng, 2, KV_HEADS), v=heads(rng, 2, KV_HEADS), o=o, lse=lse)
        expect_attention(o, lse, q, k, v, lengths,
                         lambda b, g: attended_tokens(lengths[b], window, ranked(q, k, b, g)[0][:kept]))
        o2, lse2 = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
        step.attend(layer, q, cache, o=o2, lse=lse2, selection=(indices, counts))
        np.testing.assert_array_equal(o2, o)
        np.testing.assert_array_equal(lse2, lse)
    with pytest.raises(ValueError, match=r"config.rerank.budget \(= 41\) exceeds the selector's budget \(= 40\)"):
        kvsift.SpeContextStep(layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY,
                              rope_theta=THETA, budget=40, rerank=41)
    with pytest.raises(ValueError, match=r"config.rerank \(budget_fraction 0, entries 0, mass 0.5, floor 1\) is set"):
        kvsift.SpeContextStep(layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY,
                              rope_theta=THETA, budget=40, rerank_mass=0.5)


def test_specontext_head_rope_with_yarn(rng):
    # The draft model's YaRN extension: a factor 8 over 64 positions, sequences of 300+ tokens.
    k, v, lengths, cache = random_cache(rng, [300, 377])
    step = kvsift.SpeContextStep(layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY,
                                 rope_theta=THETA, rope_interleaved=True, budget=32, yarn_factor=8.0,
                                 yarn_original_max_position_embeddings=64, max_batch=2)
    head_k = rng.standard_normal((2, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float16)
    step.prepare(cache, head_k)
    lengths += 1
    q_r = heads(rng, 2, Q_HEADS)
    step.select(q_r, np.ascontiguousarray(head_k[np.arange(2), :, lengths - 1]), cache)
    indices, counts = step.selection(2)
    expect_head_selection(indices, counts, q_r, head_k, lengths, 32, (0, 1), yarn=(8.0, 64))


def test_specontext_batch_level_selects_one_set_per_sequence(rng):
    k, v, lengths, cache = random_cache(rng, [200])
    step = kvsift.SpeContextStep(layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY,
                                 rope_theta=THETA, rope_interleaved=True, budget=24, mode="batch_level")
    head_k = rng.standard_normal((1, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float16)
    step.prepare(cache, head_k)
    lengths += 1
    q_r = heads(rng, 1, Q_HEADS)
    step.select(q_r, np.ascontiguousarray(head_k[:, :, lengths[0] - 1]), cache)
    indices, counts = step.selection(1)
    assert (counts == 24).all()
    np.testing.assert_array_equal(np.sort(indices[0, 0, :24]), np.sort(indices[0, 1, :24]))
    # The set is the top 24 of the max over all query heads' softmax weights.
    n = lengths[0]
    q = rope(q_r[0][:, None, :], [n - 1])[:, 0].astype(np.float64)
    keys = rope(head_k[0, :, :n], np.arange(n)).astype(np.float64)
    logits = np.stack([SCALE * q[h] @ keys[h // GROUP].T for h in range(Q_HEADS)])
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    score = (weights / weights.sum(-1, keepdims=True)).max(0)[:n - 1]  # the current token is the window's
    kth = np.sort(score)[::-1][23]
    assert score[indices[0, 0, :24]].min() >= kth * (1 - 1e-3)


def test_specontext_refusals(rng):
    k, v, lengths, cache = random_cache(rng, [100])
    make = lambda **kw: kvsift.SpeContextStep(**{**dict(layers=2, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                                        max_seq_len=CAPACITY, rope_theta=THETA, budget=16), **kw})
    with pytest.raises(kvsift.Error, match="mode"):
        make(mode="per_query_head")
    with pytest.raises(kvsift.Error, match="budget"):
        make(budget=0)
    with pytest.raises(kvsift.Error, match="layers"):
        make(layers=0)
    with pytest.raises(kvsift.Error, match="rotary_dim|rope"):
        make(rope_dim=HEAD_DIM + 2)
    step = make()
    with pytest.raises(kvsift.Error, match="k_pre"):  # shorter than the prompt
        step.prepare(cache, np.zeros((1, KV_HEADS, 50, HEAD_DIM), dtype=np.float16))
    with pytest.raises(kvsift.Error, match="k_pre"):
        step.prepare(cache, np.zeros((1, KV_HEADS, 100, HEAD_DIM), dtype=np.float32))
    step.prepare(cache, np.zeros((1, KV_HEADS, 100, HEAD_DIM), dtype=np.float16))
    lengths += 1
    with pytest.raises(kvsift.Error, match="q_heads"):
        step.select(heads(rng, 1, KV_HEADS), heads(rng, 1, KV_HEADS), cache)
    step.select(heads(rng, 1, Q_HEADS), heads(rng, 1, KV_HEADS), cache)
    q = heads(rng, 1, Q_HEADS)
    with pytest.raises(kvsift.Error, match="layer"):
        step.attend(2, q, cache)
    with pytest.raises(kvsift.Error, match="together"):
        step.attend(0, q, cache, k=heads(rng, 1, KV_HEADS))
    indices, counts = step.selection(1)
    with pytest.raises(kvsift.Error, match="counts"):
        step.attend(0, q, cache, selection=(indices, counts[:, :1]))
