"""Sparse and dense decode, merge and top-k through the Python package on numpy arrays, against fp64 references."""
import numpy as np
import pytest

import kvsift
from conftest import attended_tokens, middle_selection, poisoned, reference_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
GROUP = Q_HEADS // KV_HEADS


def random_problem(rng, batch=2, capacity=300, lengths=(300, 173)):
    q = rng.standard_normal((batch, Q_HEADS, HEAD_DIM)).astype(np.float16)
    # K and V live inside larger arrays: the views are strided in every dimension but the last.
    k = rng.standard_normal((batch, KV_HEADS + 1, capacity + 7, HEAD_DIM)).astype(np.float16)[:, 1:, 3:capacity + 3]
    v = rng.standard_normal((batch, KV_HEADS + 1, capacity + 7, HEAD_DIM)).astype(np.float16)[:, 1:, 3:capacity + 3]
    return q, k, v, np.array(lengths, dtype=np.int32)


def check_state(o, lse, expected, atol):
    for (b, h), (ref_o, ref_lse) in expected.items():
        np.testing.assert_allclose(o[b, h].astype(np.float64), ref_o, atol=atol, rtol=0, err_msg=f"o[{b}, {h}]")
        np.testing.assert_allclose(lse[b, h], ref_lse, atol=1e-4, rtol=1e-5, err_msg=f"lse[{b}, {h}]")


@pytest.mark.parametrize("out_dtype", ["float32", "float16"])
def test_sparse_decode_matches_fp64(rng, out_dtype):
    q, k, v, lengths = random_problem(rng)
    window, scale = (4, 16), 0.11
    indices, counts = middle_selection(rng, lengths, window, 40, KV_HEADS)
    log_weights = rng.uniform(0, 2, indices.shape).astype(np.float32)
    cache = kvsift.contiguous_cache(k, v, lengths)
    o, lse = poisoned(q.shape, out_dtype), poisoned(q.shape[:2], np.float32)
    kvsift.sparse_decode(q, cache, indices, counts, log_weights=log_weights, window=window, sm_scale=scale, o=o, lse=lse)
    expected = {}
    for b in range(len(lengths)):
        for h in range(Q_HEADS):
            g = h // GROUP
            chosen = indices[b, g, :counts[b, g]]
            weights = dict(zip(chosen.tolist(), log_weights[b, g, :counts[b, g]].tolist()))
            tokens = attended_tokens(lengths[b], window, chosen)
            w = np.array([weights.get(t, 0.0) for t in tokens])
            expected[b, h] = reference_attention(q[b, h], k[b, g, tokens], v[b, g, tokens], scale, w)
    check_state(o, lse, expected, atol=2e-3 if out_dtype == "float32" else 4e-3)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_dense_decode_paged_matches_fp64(rng, layout):
    page_size, lengths = 16, np.array([77, 16, 130], dtype=np.int32)
    batch = len(lengths)
    pages_of = [-(-int(n) // page_size) for n in lengths]
    num_pages = sum(pages_of) + 3
    order = rng.permutation(num_pages).astype(np.int32)  # pages scattered through the pool
    indptr = np.concatenate([[0], np.cumsum(pages_of)]).astype(np.int32)
    page_indices = order[:indptr[-1]].copy()
    last = np.array([n - (p - 1) * page_size for n, p in zip(lengths, pages_of)], dtype=np.int32)
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM) if layout == "NHD" else (num_pages, KV_HEADS, page_size, HEAD_DIM)
    k_pages = rng.standard_normal(shape).astype(np.float16)
    v_pages = rng.standard_normal(shape).astype(np.float16)
    q = rng.standard_normal((batch, Q_HEADS, HEAD_DIM)).astype(np.float16)
    cache = kvsift.paged_cache(k_pages, v_pages, indptr, page_indices, last, layout=layout)
    o, lse = poisoned(q.shape, np.float32), poisoned((batch, Q_HEADS), np.float32)
    kvsift.dense_decode(q, cache, o=o, lse=lse)

    def row(pages, b, g, t):
        page = page_indices[indptr[b] + t // page_size]
        return pages[page, t % page_size, g] if layout == "NHD" else pages[page, g, t % page_size]

    expected = {}
    for b in range(batch):
        for h in range(Q_HEADS):
            g = h // GROUP
            keys = np.stack([row(k_pages, b, g, t) for t in range(lengths[b])])
            values = np.stack([row(v_pages, b, g, t) for t in range(lengths[b])])
            expected[b, h] = reference_attention(q[b, h], keys, values, 1 / np.sqrt(HEAD_DIM))
    check_state(o, lse, expected, atol=2e-3)


def test_merge_of_two_halves_is_the_whole(rng):
    q, k, v, lengths = random_problem(rng, lengths=(300, 300))
    cut = 137
    first = kvsift.contiguous_cache(k[:, :, :cut], v[:, :, :cut], np.full(2, cut, np.int32))
    second = kvsift.contiguous_cache(k[:, :, cut:], v[:, :, cut:], np.full(2, 300 - cut, np.int32))
    parts = [kvsift.dense_decode(q, c, out_dtype="float32") for c in (first, second)]
    o, lse = poisoned(q.shape, np.float16), poisoned(q.shape[:2], np.float32)
    kvsift.merge_states(parts, o=o, lse=lse)
    expected = {(b, h): reference_attention(q[b, h], k[b, h // GROUP], v[b, h // GROUP], 1 / 8) for b in range(2)
                for h in range(Q_HEADS)}
    check_state(o, lse, expected, atol=4e-3)


def test_topk_rows_matches_argsort(rng):
    batch, tokens, k = 3, 500, 37
    lengths = np.array([500, 30, 260], dtype=np.int32)
    scores = rng.standard_normal((batch * KV_HEADS * GROUP, tokens)).astype(np.float32)
    scores[:, ::7] = scores[:, :1]  # ties: the smaller index wins
    window = (2, 5)
    indices, counts = kvsift.topk_rows(scores, k, batch=batch, kv_heads=KV_HEADS, lengths=lengths, window=window,
                                       heads_per_row=GROUP)
    for b in range(batch):
        for g in range(KV_HEADS):
            union = set()
            for r in range(GROUP):
                row = scores[(b * KV_HEADS + g) * GROUP + r]
                candidates = [t for t in range(window[0], lengths[b] - window[1])]
                ranked = sorted(candidates, key=lambda t: (-row[t], t))
                union |= set(ranked[:k])
            assert counts[b, g] == len(union)
            assert indices[b, g, :counts[b, g]].tolist() == sorted(union)


def test_bad_inputs_raise_kvsift_error_naming_the_argument(rng):
    q, k, v, lengths = random_problem(rng)
    cache = kvsift.contiguous_cache(k, v, lengths)
    indices, counts = middle_selection(rng, lengths, (0, 0), 8, KV_HEADS)
    counts[0, 0], indices[0, 0, 0] = max(counts[0, 0], 1), 5
    out_of_range = indices.copy()
    out_of_range[0, 0, 0] = 999
    cases = [
        (lambda: kvsift.dense_decode(q.astype(np.float32), cache), "q has dtype float32"),
        (lambda: kvsift.dense_decode(q[0], cache), "q has 2 dimensions"),
        (lambda: kvsift.dense_decode(q[:, :, ::2], cache), "q (shape [2, 8, 32]) must be contiguous in its last"),
        (lambda: kvsift.dense_decode(q, cache, lse=np.empty((3, Q_HEADS), np.float32)), "lse has shape [3, 8]"),
        (lambda: kvsift.dense_decode(q, kvsift.contiguous_cache(k, v[:, :, :10], lengths)), "cache.k (shape"),
        (lambda: kvsift.dense_decode(q, kvsift.contiguous_cache(k, v, lengths[:1])), "cache.lengths has shape [1]"),
        (lambda: kvsift.dense_decode(q, kvsift.contiguous_cache(k, v, lengths.astype(np.int64))),
         "cache.lengths has dtype"),
        (lambda: kvsift.sparse_decode(q, cache, indices, counts[:, :1].copy()), "counts has shape [2, 1]"),
        (lambda: kvsift.sparse_decode(q, cache, indices, counts[:, :1]), "counts (shape [2, 1]) must be C-contiguous"),
        (lambda: kvsift.sparse_decode(q, cache, indices, counts, o=np.empty(q.shape, np.float64)), "o has dtype"),
        (lambda: kvsift.sparse_decode(q, cache, out_of_range, counts, validate=True), "999"),
        (lambda: kvsift.merge_states([(np.zeros(q.shape, np.float16), np.zeros((2, 8), np.float32))],
                                     out_dtype="float32"), "partials of dtype float16 into o of dtype float32"),
        (lambda: kvsift.paged_cache(k, v, lengths, lengths, lengths, layout="NCHW"), "layout (= 'NCHW')"),
    ]
    for call, message in cases:
        with pytest.raises(kvsift.Error) as raised:
            call()
        assert message in str(raised.value), f"{message!r} not in {str(raised.value)!r}"
    assert issubclass(kvsift.Error, ValueError)
