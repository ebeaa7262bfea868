"""Bad input through the Python package is refused by name, never crashes the interpreter, and NaN never
vanishes (numpy, CPU): the cases of the hardening issue, each against an independent expectation."""
import numpy as np
import pytest

import kvsift
from conftest import random_float16_cache

Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 64, 256


def cache(rng, lengths):
    return random_float16_cache(rng, lengths, KV_HEADS, CAPACITY, HEAD_DIM)


def query(rng, batch=1):
    return rng.standard_normal((batch, Q_HEADS, HEAD_DIM)).astype(np.float16)


def step(selector, config, **kw):
    return kvsift.DecodeStep(selector, config, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_seq_len=CAPACITY, max_batch=1, max_slots=2, window=kw.pop("window", (4, 16)), **kw)


def test_sparse_decode_validates_indices_by_default(rng):
    # An index outside the cache used to read outside its memory (SIGSEGV); validate is on by default now.
    _, _, _, kv = cache(rng, [200])
    indices = np.zeros((1, KV_HEADS, 8), dtype=np.int32)
    indices[0, 0] = np.arange(8) + 30
    indices[0, 1] = np.arange(8) + 30
    counts = np.full((1, KV_HEADS), 8, dtype=np.int32)
    indices[0, 0, 0] = -1
    with pytest.raises(kvsift.Error, match=r"indices\[0\] \(= -1\) at batch 0, kv_head 0 is outside"):
        kvsift.sparse_decode(query(rng), kv, indices, counts)
    indices[0, 0, 0] = 4096
    with pytest.raises(kvsift.Error, match=r"indices\[0\] \(= 4096\) at batch 0, kv_head 0 is outside"):
        kvsift.sparse_decode(query(rng), kv, indices, counts)


# selector: (config, needs prefill queries)
SELECTORS = {
    "oracle_topk": ({"budget": 32}, False),
    "quest": ({"budget": 32, "page_size": 8}, False),
    "streaming_llm": ({}, False),
    "ctkvr": ({"budget": 32, "centroids": 8, "max_centroids": 16, "recalled_centroids": 2}, True),
    "csattention": ({"subspaces": 8, "centroids": 6, "list_fraction": 0.25, "keep_fraction": 0.2}, True),
    "centroidkv": ({"budget_ratio": 0.5, "sinks": 4, "recent": 16}, False),
}


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_life_cycle_is_checked_per_slot(rng, selector):
    config, with_queries = SELECTORS[selector]
    s = step(selector, config, window=(0, 0) if selector == "centroidkv" else (4, 16))
    k, v, lengths, kv = cache(rng, [200])
    queries = rng.standard_normal((1, Q_HEADS, 16, HEAD_DIM)).astype(np.float16) if with_queries else None
    with pytest.raises(kvsift.Error, match=r"slots\[0\] \(= 0\) holds no sequence: it was never prepared"):
        s.run(query(rng), kv, [0])
    with pytest.raises(kvsift.Error, match=r"slots\[0\] \(= 1\) holds no sequence: it was never prepared"):
        s.release([1])
    assert not s.prepared(0)
    s.prepare(kv, [0], queries=queries)
    assert s.prepared(0) and not s.prepared(1) and not s.prepared(7)
    o, lse = s.run(query(rng), kv, [0])  # a list of slots is taken as int32
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    s.release([0])
    assert not s.prepared(0)
    with pytest.raises(kvsift.Error, match=r"slots\[0\] \(= 0\) holds no sequence: it was released"):
        s.run(query(rng), kv, [0])
    with pytest.raises(kvsift.Error, match=r"it was released"):
        s.release([0])
    s.prepare(kv, [0], queries=queries)
    o, lse = s.run(query(rng), kv, [0])
    assert np.isfinite(o).all()


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_a_page_table_past_its_pages_is_refused_not_read(rng, selector):
    """A paged cache whose table names a page it does not have: prepare and run refuse it by name (a CTKVR prepare
    once read the keys through it and crashed the interpreter)."""
    config, with_queries = SELECTORS[selector]
    s = step(selector, config, window=(0, 0) if selector == "centroidkv" else (4, 16))
    page, length = 16, 200
    pages = -(-length // page)
    k_pages = rng.standard_normal((pages, page, KV_HEADS, HEAD_DIM)).astype(np.float16)  # NHD
    v_pages = rng.standard_normal(k_pages.shape).astype(np.float16)
    indptr = np.array([0, pages], dtype=np.int32)
    last = np.array([length - (pages - 1) * page], dtype=np.int32)
    sound = np.arange(pages, dtype=np.int32)
    wild = sound.copy()
    wild[5] = 1 << 20
    queries = rng.standard_normal((1, Q_HEADS, 16, HEAD_DIM)).astype(np.float16) if with_queries else None
    message = rf"in.cache.page_indices\[5\] \(= {1 << 20}, sequence 0\) is outside \[0, num_pages = {pages}\)"
    with pytest.raises(kvsift.Error, match=message):
        s.prepare(kvsift.paged_cache(k_pages, v_pages, indptr, wild, last), [0], queries=queries)
    assert not s.prepared(0)
    s.prepare(kvsift.paged_cache(k_pages, v_pages, indptr, sound, last), [0], queries=queries)
    with pytest.raises(kvsift.Error, match=message):
        s.run(query(rng), kvsift.paged_cache(k_pages, v_pages, indptr, wild, last), [0])


@pytest.mark.parametrize("selector", ["oracle_topk", "quest", "centroidkv"])
def test_a_nan_key_in_the_prompt_makes_its_heads_output_nan(rng, selector):
    config, _ = SELECTORS[selector]
    s = step(selector, config, window=(0, 0) if selector == "centroidkv" else (4, 16))
    k, v, lengths, kv = cache(rng, [200])
    k[0, 1, 101, 7] = np.nan  # kv head 1, a middle token
    s.prepare(kv, [0])
    o, lse = s.run(query(rng), kv, [0])
    group = Q_HEADS // KV_HEADS
    assert np.isnan(lse[0, group:]).all(), "dense attention is NaN for kv head 1's query heads"
    assert np.isfinite(lse[0, :group]).all()


@pytest.mark.parametrize("selector", ["ctkvr", "csattention"])
def test_a_nan_key_or_prefill_query_is_refused_at_prepare(rng, selector):
    config, _ = SELECTORS[selector]
    s = step(selector, config)
    k, v, lengths, kv = cache(rng, [200])
    queries = rng.standard_normal((1, Q_HEADS, 16, HEAD_DIM)).astype(np.float16)
    queries[0, 2, 3, 1] = np.nan
    with pytest.raises(kvsift.Error, match=r"in.queries holds a non-finite value at sequence 0, head 2, query 3"):
        s.prepare(kv, [0], queries=queries)
    queries[0, 2, 3, 1] = 0
    k[0, 0, 50, 2] = np.inf
    with pytest.raises(kvsift.Error, match=r"keys hold a non-finite value at sequence 0, kv head 0, token 50"):
        s.prepare(kv, [0], queries=queries)


def test_specontext_a_nan_head_query_makes_its_heads_output_nan(rng):
    s = kvsift.SpeContextStep(layers=1, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY,
                              rope_theta=10000.0, budget=16)
    k, v, lengths, kv = cache(rng, [120])
    s.prepare(kv, rng.standard_normal((1, KV_HEADS, 120, HEAD_DIM)).astype(np.float16))
    lengths += 1  # the step's token
    q_r = query(rng)
    q_r[0, 2, 5] = np.nan  # the retrieval head's query head 2: kv head 1's group
    s.select(q_r, rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16), kv)
    _, counts = s.selection()
    np.testing.assert_array_equal(counts[0], [16, -1])
    o, lse = s.attend(0, query(rng), kv, k=rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16),
                      v=rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16))
    group = Q_HEADS // KV_HEADS
    assert np.isnan(lse[0, group:]).all() and np.isnan(o[0, group:]).all()
    assert np.isfinite(lse[0, :group]).all()


def test_specontext_attend_needs_a_select_and_checks_a_given_selection(rng):
    s = kvsift.SpeContextStep(layers=2, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY,
                              rope_theta=10000.0, budget=16)
    k, v, lengths, kv = cache(rng, [120])
    with pytest.raises(kvsift.Error, match=r"no selection to attend: call select"):
        s.attend(0, query(rng), kv)
    k_pre = rng.standard_normal((1, KV_HEADS, 120, HEAD_DIM)).astype(np.float16)
    s.prepare(kv, k_pre)
    indices = np.zeros((1, KV_HEADS, 16), dtype=np.int32)
    indices[0, :, 0] = 4096  # a wild index: refused, not read
    counts = np.ones((1, KV_HEADS), dtype=np.int32)
    with pytest.raises(kvsift.Error, match=r"\(= 4096\) at batch 0, kv_head 0 is outside"):
        s.attend(0, query(rng), kv, selection=(indices, counts))


def test_messages_name_the_argument_and_value(rng):
    with pytest.raises(kvsift.Error, match=r"selector_config\['budget'\] \(= 1.5\) must be an integer"):
        step("oracle_topk", {"budget": 1.5})
    with pytest.raises(kvsift.Error, match=r"selector_config\['budget'\] \(= 1099511627776\)"):
        step("oracle_topk", {"budget": 2 ** 40})
    with pytest.raises(kvsift.Error, match=r"selector_config\['keep_fraction'\] \(= 'x'\) must be a finite number"):
        step("csattention", {"keep_fraction": "x"})
    with pytest.raises(kvsift.Error, match=r"limits.max_tokens \(= 2147483647\) is outside \[1, 2\^30"):
        kvsift.DecodeStep("oracle_topk", {"budget": 8}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          max_seq_len=2 ** 31 - 1)
    k, v, lengths, _ = cache(rng, [10])
    k.flags.writeable = False
    with pytest.raises(kvsift.Error, match=r"contiguous_cache: k is a read-only numpy array"):
        kvsift.contiguous_cache(k, v, lengths)
    with pytest.raises(kvsift.Error, match=r"contiguous_cache: lengths must be a numpy array or a torch tensor"):
        kvsift.contiguous_cache(v, v, [10])
    with pytest.raises(kvsift.Error, match=r"merge_states: partials is empty"):
        kvsift.merge_states([])


def test_topk_rows_defaults_lengths_to_the_whole_row(rng):
    scores = rng.standard_normal((2 * KV_HEADS, 50)).astype(np.float32)
    indices, counts = kvsift.topk_rows(scores, 5, batch=2, kv_heads=KV_HEADS)
    np.testing.assert_array_equal(counts, 5)
    for r in range(2 * KV_HEADS):
        expected = np.sort(np.argsort(-scores[r], kind="stable")[:5])
        np.testing.assert_array_equal(indices.reshape(2 * KV_HEADS, 5)[r], expected)
