"""kvsift.torch_ops: the torch custom ops against the package's direct calls (bit for bit: the same kernels) and an fp64
reference, torch.library.opcheck (schema, fake tensors, AOT dispatch), torch.compile(fullgraph=True) with no graph
break, a CUDA graph capture on the GPU, and the ops' refusals. Skipped without torch."""
import numpy as np
import pytest

import kvsift
from conftest import reference_attention

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("kvsift.torch_ops needs torch >= 2.4 (torch.library.custom_op)", allow_module_level=True)
import kvsift.torch_ops as torch_ops  # noqa: E402

ops = torch.ops.kvsift
Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 8, 2, 64, 300
LENGTHS = [300, 211]
WINDOW = [4, 8]
BUDGET = 24


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(1 << 31)))


def problem(gen, device="cpu"):
    """q [batch, q_heads, head_dim], a contiguous cache's tensors [k, v, lengths] and a selection of BUDGET distinct
    middle tokens per (sequence, kv head), ascending."""
    batch = len(LENGTHS)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).half()
    k = torch.randn(batch, KV_HEADS, CAPACITY, HEAD_DIM, generator=gen).half()
    v = torch.randn(batch, KV_HEADS, CAPACITY, HEAD_DIM, generator=gen).half()
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    indices = torch.empty(batch, KV_HEADS, BUDGET, dtype=torch.int32)
    for b, n in enumerate(LENGTHS):
        middle = torch.arange(WINDOW[0], n - WINDOW[1], dtype=torch.int32)
        for h in range(KV_HEADS):
            indices[b, h] = middle[torch.randperm(len(middle), generator=gen)[:BUDGET]].sort().values
    counts = torch.full((batch, KV_HEADS), BUDGET, dtype=torch.int32)
    counts[1, 1] = BUDGET // 2  # a row below capacity: its tail is never read
    indices[1, 1, BUDGET // 2:] = -7
    moved = [x.to(device) for x in (q, k, v, lengths, indices, counts)]
    return moved[0], moved[1:4], moved[4], moved[5]


def reference_sparse(q, cache, indices, counts, window):
    """fp64 attention of every query head over the window and its kv head's selected tokens: (o, lse) numpy."""
    k, v, lengths = (x.cpu().numpy() for x in cache)
    q, indices, counts = q.cpu().numpy(), indices.cpu().numpy(), counts.cpu().numpy()
    group = q.shape[1] // k.shape[1]
    o, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for b in range(q.shape[0]):
        n = lengths[b]
        window_tokens = set(range(min(window[0], n))) | set(range(max(0, n - window[1]), n))
        for h in range(q.shape[1]):
            g = h // group
            tokens = sorted(window_tokens | set(indices[b, g, :counts[b, g]].tolist()))
            o[b, h], lse[b, h] = reference_attention(q[b, h], k[b, g, tokens], v[b, g, tokens], 1 / np.sqrt(q.shape[-1]))
    return o, lse


def expect_near_reference(o, lse, want_o, want_lse):
    np.testing.assert_allclose(o.float().cpu().numpy(), want_o, atol=4e-3)
    np.testing.assert_allclose(lse.cpu().numpy(), want_lse, atol=1e-4)


def test_sparse_decode_equals_the_package_call_and_the_fp64_reference(gen):
    q, cache, indices, counts = problem(gen)
    o, lse = ops.sparse_decode(q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, None)
    want_o, want_lse = kvsift.sparse_decode(q, kvsift.contiguous_cache(*cache), indices, counts, window=tuple(WINDOW))
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    expect_near_reference(o, lse, *reference_sparse(q, cache, indices, counts, WINDOW))
    # The _into op writes the caller's outputs and workspace, poisoned first.
    o_into, lse_into = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
    workspace_bytes = torch_ops.sparse_decode_workspace_bytes(q, cache, "contiguous", BUDGET, WINDOW)
    workspace = torch.full((workspace_bytes,), 0xAB, dtype=torch.uint8) if workspace_bytes else None
    ops.sparse_decode_into(q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, o_into, lse_into, workspace)
    assert torch.equal(o_into, o) and torch.equal(lse_into, lse)


def test_sparse_decode_on_a_paged_cache_equals_the_contiguous_one(gen):
    q, (k, v, lengths), indices, counts = problem(gen)
    page_size = 16
    pages_of = [-(-n // page_size) for n in LENGTHS]
    order = torch.randperm(sum(pages_of), generator=gen).to(torch.int32)  # pages in shuffled places
    k_pages = torch.full((sum(pages_of), page_size, KV_HEADS, HEAD_DIM), float("nan")).half()  # NHD
    v_pages = torch.full_like(k_pages, float("nan"))
    indptr, first = [0], 0
    for b, n in enumerate(LENGTHS):
        for p in range(pages_of[b]):
            tokens = range(p * page_size, min(n, (p + 1) * page_size))
            slot = order[first + p]
            k_pages[slot, :len(tokens)] = k[b, :, tokens.start:tokens.stop].transpose(0, 1)
            v_pages[slot, :len(tokens)] = v[b, :, tokens.start:tokens.stop].transpose(0, 1)
        first += pages_of[b]
        indptr.append(first)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(LENGTHS, pages_of)], dtype=torch.int32)
    paged = [k_pages, v_pages, torch.tensor(indptr, dtype=torch.int32), order, last]
    o, lse = ops.sparse_decode(q, paged, "NHD", indices, counts, None, WINDOW, 0.0, None)
    want_o, want_lse = ops.sparse_decode(q, [k, v, lengths], "contiguous", indices, counts, None, WINDOW, 0.0, None)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def vllm_nhd(gen, k, v, lengths, block_size=16):
    """vLLM's NHD cache [key_cache, value_cache, block_tables, seq_lens] of a contiguous one: each row's blocks in
    shuffled places (three never used), garbage in the block-table entries past them, NaN where no token is."""
    batch, kv_heads, _, head_dim = k.shape
    blocks_of = [-(-int(n) // block_size) for n in lengths]
    max_blocks = max(blocks_of) + 2
    num_blocks = sum(blocks_of) + 3
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.randint(-2**31, 2**31 - 1, (batch, max_blocks), generator=gen, dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan")).half()
    value_cache = torch.full_like(key_cache, float("nan"))
    first = 0
    for b, n in enumerate(lengths.tolist()):
        block_tables[b, :blocks_of[b]] = ids[first:first + blocks_of[b]]
        first += blocks_of[b]
        for p in range(blocks_of[b]):
            tokens = range(p * block_size, min(n, (p + 1) * block_size))
            key_cache[block_tables[b, p], :len(tokens)] = k[b, :, tokens.start:tokens.stop].transpose(0, 1)
            value_cache[block_tables[b, p], :len(tokens)] = v[b, :, tokens.start:tokens.stop].transpose(0, 1)
    return [key_cache, value_cache, block_tables, lengths.clone()]


def test_sparse_decode_and_decode_step_on_a_vllm_cache_equal_the_contiguous_one(gen):
    q, cache, indices, counts = problem(gen)
    vllm = vllm_nhd(gen, *cache)
    o, lse = ops.sparse_decode(q, vllm, "vllm_NHD", indices, counts, None, WINDOW, 0.0, None)
    want_o, want_lse = ops.sparse_decode(q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, None)
    assert o.isfinite().all() and torch.equal(o, want_o) and torch.equal(lse, want_lse)
    o_into, lse_into = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
    workspace_bytes = torch_ops.sparse_decode_workspace_bytes(q, vllm, "vllm_NHD", BUDGET, WINDOW)
    workspace = torch.full((workspace_bytes,), 0xAB, dtype=torch.uint8) if workspace_bytes else None
    ops.sparse_decode_into(q, vllm, "vllm_NHD", indices, counts, None, WINDOW, 0.0, o_into, lse_into, workspace)
    assert torch.equal(o_into, o) and torch.equal(lse_into, lse)
    torch.library.opcheck(ops.sparse_decode.default, (q, vllm, "vllm_NHD", indices, counts, None, WINDOW, 0.0, None),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    # The decode step: each step prepared on its own cache, run through the op on it.
    steps = {"contiguous": (quest_step(), cache), "vllm_NHD": (quest_step(), vllm)}
    for layout, (step, tensors) in steps.items():
        step.prepare(torch_ops._cache("decode_step", tensors, layout))
    slots = torch.arange(len(LENGTHS), dtype=torch.int32)
    handles = {layout: torch_ops.register_step(step) for layout, (step, _) in steps.items()}
    try:
        got, want = (ops.decode_step(handles[layout], q, steps[layout][1], layout, slots, None)
                     for layout in ("vllm_NHD", "contiguous"))
        assert got[0].isfinite().all() and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        (picked, picks), (got_picked, got_picks) = (steps[layout][0].selection(len(LENGTHS))
                                                    for layout in ("contiguous", "vllm_NHD"))
        assert np.array_equal(got_picks, picks) and (picks > 0).all()
        for b in range(len(LENGTHS)):
            for h in range(KV_HEADS):
                assert np.array_equal(got_picked[b, h, :picks[b, h]], picked[b, h, :picks[b, h]])
    finally:
        for handle in handles.values():
            torch_ops.unregister_step(handle)
    with pytest.raises(kvsift.Error, match=r"layout \(= 'vllm_NDH'\) must be one of 'contiguous', 'NHD', 'HND', "
                                           r"'vllm_NHD', 'vllm_HND'"):
        ops.sparse_decode(q, vllm, "vllm_NDH", indices, counts, None, WINDOW, 0.0, None)
    with pytest.raises(kvsift.Error, match=r"a vllm_HND cache is 4 tensors \[key_cache, value_cache, block_tables, "
                                           r"seq_lens\], got 3"):
        ops.dense_decode(q, vllm[:3], "vllm_HND", 0.0, 0, None)
    with pytest.raises(kvsift.Error, match=r"cache.block_tables has dtype int64"):
        ops.dense_decode(q, vllm[:2] + [vllm[2].long(), vllm[3]], "vllm_NHD", 0.0, 0, None)


def test_dense_decode_and_merge_states_equal_the_package_calls(gen):
    q, cache, indices, counts = problem(gen)
    o, lse = ops.dense_decode(q, cache, "contiguous", 0.0, 0, torch.float32)
    want = kvsift.dense_decode(q, kvsift.contiguous_cache(*cache), out_dtype="float32")
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    everything = torch.full_like(indices, 0)
    reference = reference_sparse(q, cache, everything, torch.zeros_like(counts), [CAPACITY, 0])
    expect_near_reference(o, lse, *reference)
    # The merge op against the package's merge of the same two states.
    window_o, window_lse = ops.sparse_decode(q, cache, "contiguous", indices, torch.zeros_like(counts), None, WINDOW,
                                             0.0, torch.float32)
    merged = ops.merge_states([window_o, o], [window_lse, lse], torch.float16)
    want_merged = kvsift.merge_states([(window_o, window_lse), (o, lse)], out_dtype="float16")
    assert torch.equal(merged[0], want_merged[0]) and torch.equal(merged[1], want_merged[1])


def test_topk_rows_equals_the_package_call(gen):
    scores = torch.randn(len(LENGTHS) * KV_HEADS, CAPACITY, generator=gen)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    indices, counts = ops.topk_rows(scores, lengths, BUDGET, KV_HEADS, WINDOW, 1)
    want_indices, want_counts = kvsift.topk_rows(scores, BUDGET, batch=len(LENGTHS), kv_heads=KV_HEADS,
                                                 lengths=lengths, window=tuple(WINDOW))
    assert torch.equal(counts, want_counts) and torch.equal(indices, want_indices)
    # An independent check: each row's picks are the BUDGET best of its middle, ascending.
    for b, n in enumerate(LENGTHS):
        for h in range(KV_HEADS):
            middle = scores[b * KV_HEADS + h, WINDOW[0]:n - WINDOW[1]].double()
            best = (middle.argsort(descending=True, stable=True)[:BUDGET] + WINDOW[0]).sort().values
            assert indices[b, h].tolist() == best.tolist()


def quest_step():
    step = kvsift.DecodeStep("quest", {"budget": 64, "page_size": 16}, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, max_seq_len=CAPACITY, max_batch=len(LENGTHS), window=tuple(WINDOW))
    return step


def test_decode_step_equals_the_steps_own_run(gen):
    q, cache, _, _ = problem(gen)
    through_op, direct = quest_step(), quest_step()
    for step in (through_op, direct):
        step.prepare(kvsift.contiguous_cache(*cache))
    slots = torch.arange(len(LENGTHS), dtype=torch.int32)
    handle = torch_ops.register_step(through_op)
    try:
        o, lse = ops.decode_step(handle, q, cache, "contiguous", slots, None)
        want_o, want_lse = direct.run(q, kvsift.contiguous_cache(*cache), slots)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
        indices, counts = through_op.selection(len(LENGTHS))
        expect_near_reference(o, lse, *reference_sparse(q, cache, torch.from_numpy(indices),
                                                        torch.from_numpy(counts), WINDOW))
        o_into, lse_into = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
        ops.decode_step_into(handle, q, cache, "contiguous", slots, o_into, lse_into)
        assert torch.equal(o_into, o) and torch.equal(lse_into, lse)
    finally:
        torch_ops.unregister_step(handle)


def attention_layer(handle, q, k, v, lengths, indices, counts, scores):
    """A model's attention as engines would write it: every op once, the results combined."""
    cache = [k, v, lengths]
    o_sparse, _ = ops.sparse_decode(q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, torch.float32)
    o_dense, lse_dense = ops.dense_decode(q, cache, "contiguous", 0.0, 0, torch.float32)
    o_merged, _ = ops.merge_states([o_dense], [lse_dense], None)
    picks, picked = ops.topk_rows(scores, lengths, BUDGET, KV_HEADS, WINDOW, 1)
    o_step, _ = ops.decode_step(handle, q, cache, "contiguous", torch.arange(q.shape[0], dtype=torch.int32), None)
    return o_sparse * 2 + o_merged.float(), picks, picked, o_step


def test_torch_compile_traces_every_op_without_a_graph_break(gen):
    q, (k, v, lengths), indices, counts = problem(gen)
    scores = torch.randn(len(LENGTHS) * KV_HEADS, CAPACITY, generator=gen)
    eager_step, compiled_step = quest_step(), quest_step()
    for step in (eager_step, compiled_step):
        step.prepare(kvsift.contiguous_cache(k, v, lengths))
    eager_handle, compiled_handle = torch_ops.register_step(eager_step), torch_ops.register_step(compiled_step)
    try:
        want = attention_layer(eager_handle, q, k, v, lengths, indices, counts, scores)
        torch._dynamo.reset()
        compiled = torch.compile(attention_layer, fullgraph=True)  # a graph break raises
        got = compiled(compiled_handle, q, k, v, lengths, indices, counts, scores)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    finally:
        torch_ops.unregister_step(eager_handle)
        torch_ops.unregister_step(compiled_handle)


def test_opcheck_passes_for_every_op(gen):
    q, cache, indices, counts = problem(gen)
    scores = torch.randn(len(LENGTHS) * KV_HEADS, CAPACITY, generator=gen)
    lengths = cache[2]
    o, lse = torch.randn(q.shape, generator=gen), torch.randn(q.shape[:2], generator=gen)  # partial states
    step = quest_step()
    step.prepare(kvsift.contiguous_cache(*cache))
    handle = torch_ops.register_step(step)
    slots = torch.arange(len(LENGTHS), dtype=torch.int32)
    cases = [
        (ops.sparse_decode.default, (q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, None)),
        (ops.dense_decode.default, (q, cache, "contiguous", 0.0, 0, None)),
        (ops.merge_states.default, ([o, o], [lse, lse], None)),
        (ops.topk_rows.default, (scores, lengths, BUDGET, KV_HEADS, WINDOW, 1)),
        (ops.sparse_decode_into.default, (q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, o.clone(),
                                          lse.clone(), None)),
        (ops.decode_step.default, (handle, q, cache, "contiguous", slots, None)),
    ]
    try:
        for op, args in cases:
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    finally:
        torch_ops.unregister_step(handle)


def test_the_ops_refuse_bad_arguments_by_name(gen):
    q, cache, indices, counts = problem(gen)
    with pytest.raises(kvsift.Error, match=r"kvsift::sparse_decode_into: layout \(= 'NDH'\) must be"):
        ops.sparse_decode(q, cache, "NDH", indices, counts, None, WINDOW, 0.0, None)
    with pytest.raises(kvsift.Error, match=r"a contiguous cache is 3 tensors \[k, v, lengths\], got 2"):
        ops.dense_decode(q, cache[:2], "contiguous", 0.0, 0, None)
    with pytest.raises(kvsift.Error, match=r"o_parts \(2 tensors\) and lse_parts \(1\)"):
        ops.merge_states([q, q], [q[..., 0]], None)
    with pytest.raises(kvsift.Error, match=r"step \(= 123456\) is not a handle"):
        ops.decode_step(123456, q, cache, "contiguous", torch.zeros(2, dtype=torch.int32), None)
    with pytest.raises(kvsift.Error, match=r"register_step: step must be a kvsift.DecodeStep or SpeContextStep, not int"):
        torch_ops.register_step(3)
    with pytest.raises(kvsift.Error, match=r"unregister_step: handle \(= 99999\) is not a registered step"):
        torch_ops.unregister_step(99999)
    # A 'local' step takes one cache and no split arguments.
    handle = torch_ops.register_step(quest_step())
    slots = torch.arange(len(LENGTHS), dtype=torch.int32)
    try:
        with pytest.raises(kvsift.Error, match=r"decode_step_into: q_device and split_layout are the split "
                                               r"placements'; this step's placement is 'local'"):
            ops.decode_step(handle, q, cache, "contiguous", slots, None, q)
        with pytest.raises(kvsift.Error, match=r"a contiguous cache is 3 tensors \[k, v, lengths\], got 6"):
            ops.decode_step(handle, q, cache + cache, "contiguous", slots, None)
    finally:
        torch_ops.unregister_step(handle)
    # The C++ checks reach torch's callers unchanged: counts of the wrong dtype.
    with pytest.raises(kvsift.Error, match="counts"):
        ops.sparse_decode(q, cache, "contiguous", indices, counts.long(), None, WINDOW, 0.0, None)


@pytest.mark.skipif(not (torch.cuda.is_available() and kvsift.has_cuda), reason="needs a GPU and kvsift built with CUDA")
def test_a_cuda_graph_replays_the_ops_as_eager_calls(gen):
    q, cache, indices, counts = problem(gen, "cuda")
    scores = torch.randn(len(LENGTHS) * KV_HEADS, CAPACITY, generator=gen).cuda()
    step = kvsift.DecodeStep("quest", {"budget": 64, "page_size": 16}, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, max_seq_len=CAPACITY, max_batch=len(LENGTHS), window=tuple(WINDOW),
                             device="cuda")
    step.prepare(kvsift.contiguous_cache(*cache))
    handle = torch_ops.register_step(step)
    slots = torch.arange(len(LENGTHS), dtype=torch.int32, device="cuda")
    o = torch.full((q.shape[0], Q_HEADS, HEAD_DIM), float("nan"), dtype=torch.float16, device="cuda")
    lse = torch.full((q.shape[0], Q_HEADS), float("nan"), device="cuda")
    o_step, lse_step = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
    workspace = torch.empty(torch_ops.sparse_decode_workspace_bytes(q, cache, "contiguous", BUDGET, WINDOW),
                            dtype=torch.uint8, device="cuda")

    def run():
        ops.sparse_decode_into(q, cache, "contiguous", indices, counts, None, WINDOW, 0.0, o, lse, workspace)
        ops.decode_step_into(handle, q, cache, "contiguous", slots, o_step, lse_step)
        return ops.topk_rows(scores, cache[2], BUDGET, KV_HEADS, WINDOW, 1)

    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run()  # warm-up outside the capture (lazy initialization)
        torch.cuda.synchronize()
        want = [x.clone() for x in (o, lse, o_step, lse_step)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            picks, picked = run()
        for x in (o, lse, o_step, lse_step):
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip((o, lse, o_step, lse_step), want):
            assert torch.equal(got, expected)
        want_picks, want_picked = kvsift.topk_rows(scores, BUDGET, batch=len(LENGTHS), kv_heads=KV_HEADS,
                                                   lengths=cache[2], window=tuple(WINDOW))
        assert torch.equal(picked, want_picked) and torch.equal(picks, want_picks)
    finally:
        torch_ops.unregister_step(handle)


@pytest.mark.skipif(not (torch.cuda.is_available() and kvsift.has_cuda), reason="needs a GPU and kvsift built with CUDA")
@pytest.mark.parametrize("placement,device", [("middle_on_cpu", "cpu"), ("middle_on_gpu", "cpu"),
                                              ("middle_on_cpu", "cuda")])
def test_decode_step_ops_run_the_split_placements_as_the_steps_own_run(gen, placement, device):
    """A split step (selector on `device`) through decode_step and decode_step_into eagerly and decode_step under
    torch.compile(fullgraph=True), each on a twin of a step run directly: the same (o, lse) bit for bit over three
    decode steps, each with a fresh token in every cache and a fresh query, outputs poisoned first; then the fake
    implementation against the real outputs, and the refusals, a CUDA graph capture among them."""
    batch, capacity, nan = 2, 300, float("nan")
    k = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, generator=gen).half()
    v = torch.randn(k.shape, generator=gen).half()
    host = [k.pin_memory(), v.pin_memory(), torch.tensor([250, 197], dtype=torch.int32).pin_memory()]
    gpu = [x.cuda() for x in host]
    # The op's cache list: the step's own cache (on the selector's side), then the other half's.
    cache = host + gpu if device == "cpu" else gpu + host

    def make():
        step = kvsift.DecodeStep("quest", {"budget": 64, "page_size": 16}, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                                 head_dim=HEAD_DIM, max_seq_len=capacity, max_batch=batch, window=tuple(WINDOW),
                                 device=device, placement=placement)
        step.prepare(kvsift.contiguous_cache(*cache[:3]))
        return step
    direct, eager, into, traced = (make() for _ in range(4))  # twins: each gets the same calls
    handles = [torch_ops.register_step(step) for step in (eager, into, traced)]
    slots = torch.arange(batch, dtype=torch.int32, device=device)

    def layer(handle, q, cache, slots, q_device):
        return ops.decode_step(handle, q, cache, "contiguous", slots, None, q_device)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # a graph break raises
    try:
        for _ in range(3):
            torch.cuda.synchronize()  # the GPU reads the host cache until it passes a run: append after that
            for x in (host[2], gpu[2]):
                x += 1
            for b, n in enumerate(host[2].tolist()):  # the engine's cache write of the step's token
                for host_x, gpu_x in zip(host[:2], gpu[:2]):
                    host_x[b, :, n - 1] = torch.randn(KV_HEADS, HEAD_DIM, generator=gen).half()
                    gpu_x[b, :, n - 1] = host_x[b, :, n - 1].cuda()
            q_cpu = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).half()
            q, q_device = (q_cpu, q_cpu.cuda()) if device == "cpu" else (q_cpu.cuda(), None)
            o = torch.full((batch, Q_HEADS, HEAD_DIM), nan, dtype=torch.float16, device="cuda")
            lse = torch.full((batch, Q_HEADS), nan, device="cuda")
            o_into, lse_into = torch.full_like(o, nan), torch.full_like(lse, nan)
            second = kvsift.contiguous_cache(*cache[3:])
            split = dict(q_device=q_device, device_cache=second) if device == "cpu" else dict(host_cache=second)
            direct.run(q, kvsift.contiguous_cache(*cache[:3]), slots, o=o, lse=lse, **split)
            got = [ops.decode_step(handles[0], q, cache, "contiguous", slots, None, q_device)]
            ops.decode_step_into(handles[1], q, cache, "contiguous", slots, o_into, lse_into, q_device)
            got += [(o_into, lse_into), compiled(handles[2], q, cache, slots, q_device)]
            torch.cuda.synchronize()
            assert o.isfinite().all() and lse.isfinite().all()
            for got_o, got_lse in got:
                assert got_o.is_cuda and torch.equal(got_o, o) and torch.equal(got_lse, lse)
        # The fake implementation (what torch.compile plans with) against the real outputs: on fake copies of the
        # inputs here, not opcheck's, whose copies of the host cache are not pinned (the step refuses them).
        from torch._subclasses import FakeTensorMode
        fake_mode = FakeTensorMode()
        fake = [None if x is None else fake_mode.from_tensor(x) for x in (q, slots, q_device)]
        with fake_mode:
            planned = ops.decode_step(handles[0], fake[0], [fake_mode.from_tensor(x) for x in cache], "contiguous",
                                      fake[1], None, fake[2])
        for plan, real in zip(planned, got[0]):
            assert (plan.device, plan.dtype, plan.shape, plan.stride()) == (real.device, real.dtype, real.shape,
                                                                            real.stride())
        side = "CPU" if device == "cpu" else "GPU"
        with pytest.raises(kvsift.Error, match=rf"a '{placement}' step with its selector on the {side} takes its "
                                               rf"contiguous cache \[k, v, lengths\] then its"):
            ops.decode_step(handles[0], q, cache[:3], "contiguous", slots, None, q_device)
        with pytest.raises(kvsift.Error, match=r"layout \(= 'NDH'\) must be one of"):
            ops.decode_step(handles[0], q, cache, "contiguous", slots, None, q_device, "NDH")
        with pytest.raises(kvsift.Error, match="takes q_device" if device == "cpu" else "q_device is a CPU selector's"):
            ops.decode_step(handles[0], q, cache, "contiguous", slots, None, None if device == "cpu" else q)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(kvsift.Error, match=rf"placement '{placement}' synchronizes with the host every step and "
                                               rf"cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                ops.decode_step_into(handles[1], q, cache, "contiguous", slots, o_into, lse_into, q_device)
    finally:
        for handle in handles:
            torch_ops.unregister_step(handle)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and kvsift.has_cuda), reason="needs a GPU and kvsift built with CUDA"))])
def test_the_torch_attention_example_checks_itself(device):
    """examples/torch_attention.py: SDPA swapped for a kvsift decode step in a compiled attention module; its
    main() raises SystemExit on a mismatch."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torch_attention.py"
    spec = importlib.util.spec_from_file_location("torch_attention", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch._dynamo.reset()
    assert example.main(["--device", device]) == 0


def test_the_model_benchmark_wiring_checks_itself():
    """bench/model_decode.py --tiny: what attention adds to a 2-layer model's logits, with kvsift's dense decode and
    with OracleTopK keeping every token, equals SDPA's; a 16-token selection must differ."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "model_decode.py"
    spec = importlib.util.spec_from_file_location("model_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--tiny"]) == 0


def test_specontext_ops_equal_the_steps_own_calls_and_compile(gen):
    """specontext_select then specontext_attend per layer, through the ops (eager and compiled) and directly on a
    twin step: the same selection and outputs bit for bit, over two model steps."""
    layers, budget = 2, 32
    q, (k0, v0, lengths), _, _ = problem(gen)
    caches = [[k0, v0, lengths]] + [[torch.randn(k0.shape, generator=gen).half(),
                                     torch.randn(v0.shape, generator=gen).half(), lengths] for _ in range(layers - 1)]
    head_k = torch.randn(len(LENGTHS), KV_HEADS, CAPACITY, HEAD_DIM, generator=gen).half()

    def make():
        step = kvsift.SpeContextStep(layers=layers, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     max_seq_len=CAPACITY, rope_theta=10000.0, budget=budget, window=tuple(WINDOW),
                                     max_batch=len(LENGTHS))
        prompt = lengths - 1  # the prompt, then one decode token
        step.prepare(kvsift.contiguous_cache(k0, v0, prompt), head_k)
        return step
    eager_step, compiled_step, direct = make(), make(), make()
    slots = torch.arange(len(LENGTHS), dtype=torch.int32)
    handles = [torch_ops.register_step(s) for s in (eager_step, compiled_step)]

    def model_step(handle, q_r, k_r, qs, *tensors):
        ticket = ops.specontext_select(handle, q_r, k_r, [tensors[0], tensors[1], tensors[2]], "contiguous", slots)
        outs = []
        for layer in range(layers):
            cache = [tensors[3 * layer], tensors[3 * layer + 1], tensors[3 * layer + 2]]
            outs.append(ops.specontext_attend(handle, layer, qs[layer], cache, "contiguous", ticket, None)[0])
        return torch.stack(outs)

    compiled = torch.compile(model_step, fullgraph=True)
    flat = [t for cache in caches for t in cache]
    try:
        for _ in range(2):
            q_r = torch.randn(len(LENGTHS), Q_HEADS, HEAD_DIM, generator=gen).half()
            k_r = torch.randn(len(LENGTHS), KV_HEADS, HEAD_DIM, generator=gen).half()
            qs = torch.randn(layers, len(LENGTHS), Q_HEADS, HEAD_DIM, generator=gen).half()
            direct.select(q_r, k_r, kvsift.contiguous_cache(*caches[0]), slots)
            want = torch.stack([direct.attend(layer, qs[layer], kvsift.contiguous_cache(*caches[layer]))[0]
                                for layer in range(layers)])
            eager = model_step(handles[0], q_r, k_r, qs, *flat)
            got = compiled(handles[1], q_r, k_r, qs, *flat)
            assert torch.equal(eager, want) and torch.equal(got, want)
            for step in (eager_step, compiled_step):
                for a, b in zip(step.selection(len(LENGTHS)), direct.selection(len(LENGTHS))):
                    np.testing.assert_array_equal(a, b)
        with pytest.raises(kvsift.Error, match=r"is a SpeContextStep, this op runs a DecodeStep"):
            ops.decode_step(handles[0], q, caches[0], "contiguous", slots, None)
    finally:
        for h in handles:
            torch_ops.unregister_step(h)
