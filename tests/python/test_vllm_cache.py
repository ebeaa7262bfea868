"""vLLM's paged cache read in place (kvsift.vllm_cache, kvsift.vllm_interleaved_cache): the tokens of a contiguous
cache laid out as vLLM does, in shuffled blocks with garbage in the unused block-table entries and NaN in every
element that holds no token, give the contiguous cache's outputs bit for bit in dense and sparse decode and in a
DecodeStep that writes its tokens into the blocks; malformed tables are refused by name."""
import numpy as np
import pytest

import kvsift
from conftest import middle_selection, poisoned

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
BLOCK_SIZE = 16
LENGTHS = (77, 16, 130, 1)  # a partial last block, one full block, a long row, one token
WINDOW = (4, 8)
FORMS = ("separate", "slices", "interleaved")


def blocks_of(tokens):
    return -(-int(tokens) // BLOCK_SIZE)


def contiguous_problem(rng, capacity, lengths=LENGTHS):
    """K, V [batch, kv_heads, capacity, head_dim] float16 with NaN past each length, and lengths int32."""
    shape = (len(lengths), KV_HEADS, capacity, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float16)
    v = rng.standard_normal(shape).astype(np.float16)
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    return k, v, np.array(lengths, dtype=np.int32)


def to_vllm(rng, k, v, lengths, room, layout):
    """vLLM's interleaved kv_cache [num_blocks, 2, page...] (NHD page [block_size, kv_heads, head_dim], HND [kv_heads,
    block_size, head_dim]) holding tokens [0, lengths[b]) of k, v, and block_tables [batch, max_blocks] int32: row b
    has its first blocks_of(room[b]) entries from shuffled block ids (five blocks never used), then garbage (two
    entries at least); every element that holds no token is NaN."""
    batch = len(lengths)
    used = [blocks_of(r) for r in room]
    max_blocks = max(used) + 2
    num_blocks = sum(used) + 5
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, (batch, max_blocks), dtype=np.int32)
    first = 0
    for b in range(batch):
        tables[b, :used[b]] = ids[first:first + used[b]]
        first += used[b]
    page = (BLOCK_SIZE, KV_HEADS, HEAD_DIM) if layout == "NHD" else (KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    kv_cache = np.full((num_blocks, 2) + page, np.nan, np.float16)
    for b in range(batch):
        for t in range(lengths[b]):
            for h in range(KV_HEADS):
                kv_cache[element(layout, tables, b, h, t, 0)] = k[b, h, t]
                kv_cache[element(layout, tables, b, h, t, 1)] = v[b, h, t]
    return kv_cache, tables


def element(layout, tables, b, h, t, kv):
    """The index of token t, kv head h of sequence b in an interleaved kv_cache (kv: 0 keys, 1 values)."""
    block, offset = tables[b, t // BLOCK_SIZE], t % BLOCK_SIZE
    return (block, kv, offset, h) if layout == "NHD" else (block, kv, h, offset)


def vllm_cache(kv_cache, tables, seq_lens, layout, form):
    """The kvsift cache over vLLM's tensors: 'separate' key_cache and value_cache (packed copies, as vLLM's
    FlashAttention backend keeps them), 'slices' kv_cache[:, 0] and kv_cache[:, 1] (strided), or 'interleaved'
    (kv_cache itself, vLLM's FlashInfer backend). Returns (the kvsift cache, what holds its tokens, indexed as an
    interleaved kv_cache by element())."""
    if form == "interleaved":
        return kvsift.vllm_interleaved_cache(kv_cache, tables, seq_lens, layout), kv_cache
    if form == "slices":
        return kvsift.vllm_cache(kv_cache[:, 0], kv_cache[:, 1], tables, seq_lens, layout), kv_cache
    key_cache, value_cache = np.ascontiguousarray(kv_cache[:, 0]), np.ascontiguousarray(kv_cache[:, 1])
    # One interleaved view of the two copies for element(): writes through the cache land in key_cache/value_cache.
    return kvsift.vllm_cache(key_cache, value_cache, tables, seq_lens, layout), SeparateCaches(key_cache, value_cache)


class SeparateCaches:
    """key_cache and value_cache indexed as one interleaved kv_cache (element()'s indices)."""

    def __init__(self, key_cache, value_cache):
        self.caches = (key_cache, value_cache)

    def __getitem__(self, index):
        return self.caches[index[1]][(index[0],) + index[2:]]


def check_rows(layout, held, tables, k, v, lengths):
    """Every token of every row as the vLLM cache holds it (addressed from its shapes) equals the contiguous one."""
    for b in range(len(lengths)):
        for t in range(lengths[b]):
            for h in range(KV_HEADS):
                assert held[element(layout, tables, b, h, t, 0)].tobytes() == k[b, h, t].tobytes(), (b, h, t)
                assert held[element(layout, tables, b, h, t, 1)].tobytes() == v[b, h, t].tobytes(), (b, h, t)


def same_bits(got, want):
    """Outputs written (finite: poisoned with NaN before the call) and bit for bit equal."""
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_dense_and_sparse_decode_equal_the_contiguous_cache(rng, layout, form):
    k, v, lengths = contiguous_problem(rng, capacity=max(LENGTHS))
    kv_cache, tables = to_vllm(rng, k, v, lengths, lengths, layout)
    cache, held = vllm_cache(kv_cache, tables, lengths.copy(), layout, form)
    check_rows(layout, held, tables, k, v, lengths)
    assert cache.is_paged and cache.batch == len(LENGTHS)
    contiguous = kvsift.contiguous_cache(k, v, lengths)
    batch = len(LENGTHS)
    q = rng.standard_normal((batch, Q_HEADS, HEAD_DIM)).astype(np.float16)
    indices, counts = middle_selection(rng, LENGTHS, WINDOW, 40, KV_HEADS)
    log_weights = rng.uniform(0, 2, indices.shape).astype(np.float32)
    for pool in (None, kvsift.ThreadPool(3)):
        for out_dtype in ("float32", "float16"):
            outs = []
            for c in (contiguous, cache):
                o, lse = poisoned(q.shape, out_dtype), poisoned((batch, Q_HEADS), np.float32)
                kvsift.dense_decode(q, c, o=o, lse=lse, pool=pool)
                so, slse = poisoned(q.shape, out_dtype), poisoned((batch, Q_HEADS), np.float32)
                kvsift.sparse_decode(q, c, indices, counts, log_weights=log_weights, window=WINDOW, sm_scale=0.1,
                                     o=so, lse=slse, pool=pool)
                outs.append((o, lse, so, slse))
            same_bits(outs[1], outs[0])


@pytest.mark.parametrize("form", ["separate", "interleaved"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("selector, config", [("oracle_topk", {"budget": 24}),
                                              ("quest", {"budget": 48, "page_size": 16})])
def test_a_decode_step_equals_the_contiguous_cache(rng, selector, config, layout, form):
    """Prepare on the prompts, then steps whose token the DecodeStep writes into its block (vLLM has allocated the
    blocks the lengths grow into): outputs and selections equal the contiguous cache's every step."""
    steps = 6
    k, v, lengths = contiguous_problem(rng, capacity=max(LENGTHS) + steps, lengths=(77, 16, 130, 40))
    kv_cache, tables = to_vllm(rng, k, v, lengths, lengths + steps, layout)
    seq_lens = lengths.copy()
    cache, held = vllm_cache(kv_cache, tables, seq_lens, layout, form)
    contiguous = kvsift.contiguous_cache(k, v, lengths)
    batch = len(lengths)
    made = []
    for c in (contiguous, cache):
        step = kvsift.DecodeStep(selector, config, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 max_seq_len=k.shape[2], max_batch=batch, window=WINDOW)
        step.prepare(c)
        made.append(step)
    for _ in range(steps):
        lengths += 1  # the caches read their lengths in place
        seq_lens += 1
        q = rng.standard_normal((batch, Q_HEADS, HEAD_DIM)).astype(np.float16)
        new_k = rng.standard_normal((batch, KV_HEADS, HEAD_DIM)).astype(np.float16)
        new_v = rng.standard_normal((batch, KV_HEADS, HEAD_DIM)).astype(np.float16)
        outs = []
        for step, c in zip(made, (contiguous, cache)):
            o, lse = poisoned(q.shape, np.float32), poisoned((batch, Q_HEADS), np.float32)
            step.run(q, c, k=new_k, v=new_v, o=o, lse=lse)
            outs.append((o, lse))
        same_bits(outs[1], outs[0])
        (indices, counts), (got_indices, got_counts) = made[0].selection(batch), made[1].selection(batch)
        np.testing.assert_array_equal(got_counts, counts)
        assert (counts > 0).any()
        for b in range(batch):
            for h in range(KV_HEADS):
                np.testing.assert_array_equal(got_indices[b, h, :counts[b, h]], indices[b, h, :counts[b, h]])
    check_rows(layout, held, tables, k, v, lengths)  # the written tokens in their blocks, nothing else touched


def test_malformed_vllm_caches_are_refused_by_name(rng):
    k, v, lengths = contiguous_problem(rng, capacity=max(LENGTHS))
    kv_cache, tables = to_vllm(rng, k, v, lengths, lengths, "NHD")
    num_blocks, max_blocks = kv_cache.shape[0], tables.shape[1]
    key_cache, value_cache = np.ascontiguousarray(kv_cache[:, 0]), np.ascontiguousarray(kv_cache[:, 1])
    q = rng.standard_normal((len(LENGTHS), Q_HEADS, HEAD_DIM)).astype(np.float16)

    def dense(*arrays, layout="NHD"):
        return lambda: kvsift.dense_decode(q, kvsift.vllm_cache(*arrays, layout=layout))

    def interleaved(*arrays, layout="NHD"):
        return lambda: kvsift.dense_decode(q, kvsift.vllm_interleaved_cache(*arrays, layout=layout))

    out_of_range, negative = tables.copy(), tables.copy()
    out_of_range[1, 0] = num_blocks
    negative[2, 3] = -1
    negative_length = lengths.copy()
    negative_length[1] = -3
    read_only = tables.copy()
    read_only.flags.writeable = False
    cases = [
        (dense(key_cache, value_cache, tables.astype(np.int64), lengths),
         "cache.block_tables has dtype int64; expected int32"),
        (dense(key_cache, value_cache, tables, lengths[:3].copy()),
         "cache.seq_lens has shape [3]: dimension 0 (batch, cache.block_tables' dimension 0) must be 4"),
        (dense(key_cache, value_cache, tables, lengths.astype(np.int64)), "cache.seq_lens has dtype int64"),
        (dense(key_cache, value_cache, tables, lengths, layout="NCHW"),
         "KVCache.vllm: layout (= 'NCHW') must be 'NHD' or 'HND'"),
        (interleaved(kv_cache, tables, lengths, layout="HDN"),
         "KVCache.vllm_interleaved: layout (= 'HDN') must be 'NHD' or 'HND'"),
        (dense(key_cache, value_cache, out_of_range, lengths),
         f"kv.page_indices[{max_blocks}] (= {num_blocks}, block 0 of sequence 1's block-table row) is outside "
         f"[0, num_pages = {num_blocks})"),
        (dense(key_cache, value_cache, negative, lengths),
         f"kv.page_indices[{2 * max_blocks + 3}] (= -1, block 3 of sequence 2's block-table row) is outside"),
        (interleaved(kv_cache, out_of_range, lengths), f"kv.page_indices[{max_blocks}] (= {num_blocks}"),
        (dense(key_cache, value_cache, tables[:, :2].copy(), lengths),
         "kv.block_table_stride (= 2) is smaller than the 5 pages of kv.seq_lens[0] (= 77 tokens, page_size = 16)"),
        (dense(key_cache, value_cache, tables, negative_length), "kv.seq_lens[1] (= -3) is negative"),
        (dense(key_cache, value_cache, tables[:, :6], lengths),  # a column slice: rows strided
         "cache.block_tables (shape [4, 6]) must be C-contiguous"),
        (dense(key_cache, value_cache, tables[:, :0].copy(), lengths),
         "cache.block_tables has shape [4, 0]: it holds batch >= 1 rows of max_blocks >= 1 entries"),
        (dense(key_cache, value_cache, tables[0], lengths), "cache.block_tables has 1 dimensions"),
        (dense(key_cache, value_cache[:-1], tables, lengths),
         "cache.key_cache (shape [21, 16, 2, 64]) and cache.value_cache (shape [20, 16, 2, 64]) must have one shape"),
        (dense(key_cache.astype(np.float32), value_cache, tables, lengths), "cache.key_cache has dtype float32"),
        (interleaved(np.ascontiguousarray(kv_cache[:, :1]), tables, lengths),
         "cache.kv_cache has shape [21, 1, 16, 2, 64]: dimension 1 (K and V) must be 2"),
        (interleaved(kv_cache[::2], tables, lengths), "cache.kv_cache (shape [11, 2, 16, 2, 64]) must be C-contiguous"),
        (interleaved(key_cache, tables, lengths), "cache.kv_cache has 4 dimensions"),
        (dense(key_cache, value_cache, read_only, lengths),
         "kvsift.vllm_cache: block_tables is a read-only numpy array"),
        (dense(key_cache, value_cache, tables.tolist(), lengths),
         "kvsift.vllm_cache: block_tables must be a numpy array or a torch tensor, not list"),
    ]
    assert num_blocks == 21 and max_blocks == 11  # the shapes the messages above spell out
    for call, message in cases:
        with pytest.raises(kvsift.Error) as raised:
            call()
        assert message in str(raised.value), f"{message!r} not in {str(raised.value)!r}"


def test_a_step_refuses_a_token_past_the_block_table_and_a_wild_block(rng):
    k, v, lengths = contiguous_problem(rng, capacity=40, lengths=(32, 20))
    kv_cache, tables = to_vllm(rng, k, v, lengths, lengths, "NHD")
    narrow = tables[:, :2].copy()  # room for 32 tokens a row
    seq_lens = lengths.copy()
    cache = kvsift.vllm_interleaved_cache(kv_cache, narrow, seq_lens)
    step = kvsift.DecodeStep("oracle_topk", {"budget": 8}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_seq_len=40, max_batch=2, window=WINDOW)
    step.prepare(cache)
    q = rng.standard_normal((2, Q_HEADS, HEAD_DIM)).astype(np.float16)
    new_k = rng.standard_normal((2, KV_HEADS, HEAD_DIM)).astype(np.float16)
    before = kv_cache.copy()
    seq_lens += 1  # row 0's 33rd token needs a third block its row does not have
    with pytest.raises(kvsift.Error, match=r"cache.seq_len\(0\) \(= 33\) does not fit the cache's storage"):
        step.run(q, cache, k=new_k, v=new_k)
    assert np.array_equal(kv_cache, before, equal_nan=True)  # a refusal writes nothing
    seq_lens[0] -= 1
    narrow[1, 0] = kv_cache.shape[0] + 100
    with pytest.raises(kvsift.Error, match=rf"page_indices\[2\] \(= {narrow[1, 0]}, block 0 of sequence 1's "
                                           r"block-table row\) is outside \[0, num_pages = 9\)"):
        step.run(q, cache)
