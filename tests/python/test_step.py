"""The decode step with the reference selectors through the Python package (numpy, CPU), against fp64."""
import numpy as np
import pytest

import kvsift
from conftest import attended_tokens, poisoned, random_float16_cache, reference_attention

Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 6, 2, 64, 512
GROUP = Q_HEADS // KV_HEADS
WINDOW = (4, 16)


def make_cache(rng, lengths):
    return random_float16_cache(rng, lengths, KV_HEADS, CAPACITY, HEAD_DIM)


def expected_state(q, k, v, lengths, indices, counts, window):
    out = {}
    for b in range(len(lengths)):
        for h in range(Q_HEADS):
            g = h // GROUP
            tokens = attended_tokens(lengths[b], window, indices[b, g, :counts[b, g]])
            out[b, h] = reference_attention(q[b, h], k[b, g, tokens], v[b, g, tokens], 1 / np.sqrt(HEAD_DIM))
    return out


@pytest.mark.parametrize("selector,config", [("oracle_topk", {"budget": 40}), ("quest", {"budget": 64, "page_size": 16}),
                                             ("streaming_llm", {})])
def test_step_attends_its_selection_and_writes_the_token(rng, selector, config):
    pool = kvsift.ThreadPool(2)
    k, v, lengths, cache = make_cache(rng, [300, 451])
    step = kvsift.DecodeStep(selector, config, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_seq_len=CAPACITY, max_batch=2, max_slots=3, window=WINDOW, pool=pool)
    slots = np.array([2, 0], dtype=np.int32)
    step.prepare(cache, slots)
    for _ in range(3):  # decode steps: the engine grows the lengths, the step writes the new token
        lengths += 1
        q = rng.standard_normal((2, Q_HEADS, HEAD_DIM)).astype(np.float16)
        new_k = rng.standard_normal((2, KV_HEADS, HEAD_DIM)).astype(np.float16)
        new_v = rng.standard_normal((2, KV_HEADS, HEAD_DIM)).astype(np.float16)
        o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
        step.run(q, cache, slots, k=new_k, v=new_v, o=o, lse=lse)
        for b in range(2):
            np.testing.assert_array_equal(k[b, :, lengths[b] - 1], new_k[b])
            np.testing.assert_array_equal(v[b, :, lengths[b] - 1], new_v[b])
        indices, counts = step.selection(2)
        assert indices.shape[:2] == (2, KV_HEADS) and indices.shape[2] >= step.capacity and counts.shape == (2, KV_HEADS)
        assert (counts >= 0).all() and (counts <= step.capacity).all()
        if selector == "oracle_topk":
            assert (counts == config["budget"]).all()
        if selector == "streaming_llm":
            assert (counts == 0).all()
        for b in range(2):
            for g in range(KV_HEADS):
                chosen = indices[b, g, :counts[b, g]]
                assert len(set(chosen.tolist())) == len(chosen)
                assert ((chosen >= WINDOW[0]) & (chosen < lengths[b] - WINDOW[1])).all()
        expected = expected_state(q, k, v, lengths, indices, counts, WINDOW)
        for (b, h), (ref_o, ref_lse) in expected.items():
            np.testing.assert_allclose(o[b, h], ref_o, atol=2e-3, rtol=0)
            np.testing.assert_allclose(lse[b, h], ref_lse, atol=1e-4, rtol=1e-5)


def test_quests_pages_are_attended_without_expansion(rng):
    """page_selections=True: the step lists Quest's pages (selection_page_size 16), whose middle tokens are the token
    step's selection in order, and attends them: the fp64 reference over those tokens."""
    k, v, lengths, cache = make_cache(rng, [300, 451])
    steps = [kvsift.DecodeStep("quest", {"budget": 64, "page_size": 16}, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                               head_dim=HEAD_DIM, max_seq_len=CAPACITY, max_batch=2, window=WINDOW, page_selections=pages)
             for pages in (False, True)]
    assert [s.selection_page_size for s in steps] == [1, 16]
    for s in steps:
        s.prepare(cache, [0, 1])
    q = rng.standard_normal((2, Q_HEADS, HEAD_DIM)).astype(np.float16)
    tokens_state, pages_state = (s.run(q, cache, [0, 1], out_dtype="float32") for s in steps)
    (indices, counts), (pages, page_counts) = steps[0].selection(2), steps[1].selection(2)
    assert pages.shape[2] == 4
    for b in range(2):
        middle = range(WINDOW[0], lengths[b] - WINDOW[1])
        for g in range(KV_HEADS):
            expanded = [t for p in pages[b, g, :page_counts[b, g]] for t in range(16 * p, 16 * p + 16) if t in middle]
            assert expanded == indices[b, g, :counts[b, g]].tolist()
    expected = expected_state(q, k, v, lengths, indices, counts, WINDOW)
    for (b, h), (ref_o, ref_lse) in expected.items():
        np.testing.assert_allclose(pages_state[0][b, h], ref_o, atol=2e-3, rtol=0)
        np.testing.assert_allclose(pages_state[1][b, h], ref_lse, atol=1e-4, rtol=1e-5)
    with pytest.raises(kvsift.Error, match="page_selections applies to placement 'local'"):
        kvsift.DecodeStep("quest", {"budget": 64}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          max_seq_len=CAPACITY, placement="middle_on_cpu", page_selections=True)


def test_oracle_with_the_whole_budget_is_dense(rng):
    k, v, lengths, cache = make_cache(rng, [CAPACITY])
    step = kvsift.DecodeStep("oracle_topk", {"budget": CAPACITY}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_seq_len=CAPACITY)
    step.prepare(cache)
    q = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
    o, lse = step.run(q, cache, out_dtype="float32")
    dense_o, dense_lse = kvsift.dense_decode(q, cache, out_dtype="float32")
    np.testing.assert_allclose(o, dense_o, atol=1e-5)
    np.testing.assert_allclose(lse, dense_lse, atol=1e-5)


def test_step_refuses_bad_configuration_and_inputs(rng):
    k, v, lengths, cache = make_cache(rng, [100])
    shape = dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY)
    cases = [
        (lambda: kvsift.DecodeStep("h2o", {}, **shape), "selector (= 'h2o') must be one of"),
        (lambda: kvsift.DecodeStep("quest", {"budget": 64, "pages": 4}, **shape), "keys dict_keys(['pages'])"),
        (lambda: kvsift.DecodeStep("oracle_topk", {}, **shape), "selector_config lacks 'budget'"),
        (lambda: kvsift.DecodeStep("oracle_topk", {"budget": 0}, **shape), "config.budget (= 0) must be positive"),
        (lambda: kvsift.DecodeStep("quest", {"budget": 8}, **shape), "config.budget (= 8) is smaller than one page"),
        (lambda: kvsift.DecodeStep("ctkvr", {"budget": 8, "max_unindexed": -1}, **shape),
         "config.max_unindexed (= -1) must not be negative"),
        (lambda: kvsift.DecodeStep("oracle_topk", {"budget": 8}, dtype="float32", **shape), "dtype (= 'float32')"),
        (lambda: kvsift.DecodeStep("oracle_topk", {"budget": 8}, device="tpu", **shape), "device (= 'tpu')"),
    ]
    step = kvsift.DecodeStep("oracle_topk", {"budget": 8}, **shape)
    step.prepare(cache)
    q = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
    cases += [
        (lambda: step.run(q[:, :4], cache), "q_heads"),
        (lambda: step.run(np.concatenate([q, q]), cache), "in.q.batch (= 2) is outside [1, config.max_batch = 1]"),
        (lambda: step.run(q, cache, k=k[:, :, 0]), "k and v must be given together"),
        (lambda: step.run(q, cache, np.array([1], np.int32)), "slot"),
        (lambda: step.selection(2), "batch (= 2) is outside [1, max_batch = 1]"),
    ]
    for call, message in cases:
        with pytest.raises(kvsift.Error) as raised:
            call()
        assert message in str(raised.value), f"{message!r} not in {str(raised.value)!r}"


def test_step_on_a_paged_cache_equals_the_contiguous_one(rng):
    """The same tokens in scattered NHD pages: the step writes the new token into its page and selects and
    attends exactly as on the contiguous cache."""
    page_size, length = 16, 200
    k, v, lengths, contiguous = make_cache(rng, [length])
    pages = CAPACITY // page_size
    order = rng.permutation(pages + 5)[:pages].astype(np.int32)
    k_pages = np.zeros((pages + 5, page_size, KV_HEADS, HEAD_DIM), np.float16)
    v_pages = np.zeros_like(k_pages)
    for t in range(length):
        k_pages[order[t // page_size], t % page_size] = k[0, :, t]
        v_pages[order[t // page_size], t % page_size] = v[0, :, t]
    indptr = np.array([0, -(-(length + 1) // page_size)], np.int32)
    last = np.array([(length + 1) - (indptr[1] - 1) * page_size], np.int32)
    paged = kvsift.paged_cache(k_pages, v_pages, indptr, order[:indptr[1]].copy(), last)
    steps = []
    for cache in (contiguous, paged):
        step = kvsift.DecodeStep("quest", {"budget": 64}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 max_seq_len=CAPACITY, window=WINDOW)
        steps.append(step)
    lengths_before = np.array([length], np.int32)
    steps[0].prepare(kvsift.contiguous_cache(k, v, lengths_before))
    prefill_last = np.array([length - (-(-length // page_size) - 1) * page_size], np.int32)
    steps[1].prepare(kvsift.paged_cache(k_pages, v_pages, np.array([0, -(-length // page_size)], np.int32),
                                        order[:-(-length // page_size)].copy(), prefill_last))
    lengths += 1
    q = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
    new_k = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
    new_v = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
    outs = [step.run(q, cache, k=new_k, v=new_v, out_dtype="float32") for step, cache in zip(steps, (contiguous, paged))]
    np.testing.assert_array_equal(k_pages[order[length // page_size], length % page_size], new_k[0])
    (indices, counts), (paged_indices, paged_counts) = steps[0].selection(), steps[1].selection()
    np.testing.assert_array_equal(paged_counts, counts)
    assert (counts > 0).all()
    for h in range(KV_HEADS):
        np.testing.assert_array_equal(paged_indices[0, h, :counts[0, h]], indices[0, h, :counts[0, h]])
    np.testing.assert_allclose(outs[1][0], outs[0][0], atol=1e-6)
    np.testing.assert_allclose(outs[1][1], outs[0][1], atol=1e-6)


def test_ctkvr_with_whole_lists_selects_the_top_of_the_middle_and_reports_its_union(rng):
    # C' = C and lists holding the prompt's whole middle: each step's selection is the budget's best tokens of the
    # middle by the softmax over it, max over the GQA group; the union of the lists is the prompt's middle.
    k, v, lengths, cache = make_cache(rng, [300])
    middle = 300 - WINDOW[0] - WINDOW[1]
    budget = 20
    step = kvsift.DecodeStep("ctkvr", {"budget": budget, "list_size": middle, "centroids": 6, "max_centroids": 6,
                                       "recalled_centroids": 6},
                             q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY, window=WINDOW)
    queries = rng.standard_normal((1, Q_HEADS, 8, HEAD_DIM)).astype(np.float16)
    slots = np.zeros(1, dtype=np.int32)
    step.prepare(cache, slots, queries=queries)
    for s in range(3):
        lengths += 1
        q = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
        new_k = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
        new_v = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
        step.run(q, cache, slots, k=new_k, v=new_v)
        indices, counts = step.selection()
        unions = step.union_sizes()
        assert unions.shape == (1, KV_HEADS)
        lo, hi = WINDOW[0], lengths[0] - WINDOW[1]
        for g in range(KV_HEADS):
            if s == 0:
                assert unions[0, g] == middle
            logits = np.einsum("hd,td->ht", q[0, g * GROUP:(g + 1) * GROUP].astype(np.float64),
                               k[0, g, lo:hi].astype(np.float64)) / np.sqrt(HEAD_DIM)
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            best = (weights / weights.sum(axis=1, keepdims=True)).max(axis=0)
            assert counts[0, g] == budget
            chosen = indices[0, g, :budget] - lo
            kth = np.sort(best)[::-1][budget - 1]
            assert (best[chosen] >= kth - 1e-5).all()
            assert (np.delete(best, chosen) <= kth + 1e-5).all()
    oracle = kvsift.DecodeStep("oracle_topk", {"budget": 8}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               max_seq_len=CAPACITY)
    with pytest.raises(kvsift.Error, match="reports no union sizes"):
        oracle.union_sizes()


def test_csattention_selects_its_budget_and_attends_it(rng):
    # Plumbing of CsattentionConfig through the package (the selection itself is tested against fp64 in C++):
    # the budget counts the window, so each row selects budget - sink - recent middle tokens, and the output is the
    # attention over them and the window.
    k, v, lengths, cache = make_cache(rng, [300])
    budget = 40
    step = kvsift.DecodeStep("csattention", {"budget": budget, "centroids": 4, "subspaces": 4, "list_fraction": 0.5},
                             q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY, window=WINDOW)
    slots = np.zeros(1, dtype=np.int32)
    step.prepare(cache, slots, queries=rng.standard_normal((1, Q_HEADS, 8, HEAD_DIM)).astype(np.float16))
    for _ in range(3):
        lengths += 1
        q = rng.standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16)
        new_k = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
        new_v = rng.standard_normal((1, KV_HEADS, HEAD_DIM)).astype(np.float16)
        o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
        step.run(q, cache, slots, k=new_k, v=new_v, o=o, lse=lse)
        indices, counts = step.selection()
        assert (counts == budget - sum(WINDOW)).all()
        for g in range(KV_HEADS):
            chosen = indices[0, g, :counts[0, g]]
            assert len(set(chosen.tolist())) == len(chosen)
            assert ((chosen >= WINDOW[0]) & (chosen < lengths[0] - WINDOW[1])).all()
        for (b, h), (ref_o, ref_lse) in expected_state(q, k, v, lengths, indices, counts, WINDOW).items():
            np.testing.assert_allclose(o[b, h], ref_o, atol=2e-3, rtol=0)
            np.testing.assert_allclose(lse[b, h], ref_lse, atol=1e-4, rtol=1e-5)
    shape = dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY)
    for config, message in [({"list_fraction": 0.0}, "config.list_fraction (alpha = 0) is outside (0, 1]"),
                            ({"subspaces": 5}, "config.subspaces (m = 5) does not divide head_dim (= 64)"),
                            ({"lists": 3}, "keys dict_keys(['lists'])")]:
        with pytest.raises(kvsift.Error) as raised:
            kvsift.DecodeStep("csattention", config, **shape)
        assert message in str(raised.value), f"{message!r} not in {str(raised.value)!r}"


def rerank_scores(q, k, b, g, candidates):
    """fp64 exact scores of the rerank stage: per candidate token of row (b, g), the GQA group's maximum of each
    query head's softmax over the candidates."""
    logits = q[b, g * GROUP:(g + 1) * GROUP].astype(np.float64) @ k[b, g, candidates].astype(np.float64).T
    logits /= np.sqrt(HEAD_DIM)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (weights / weights.sum(axis=1, keepdims=True)).max(axis=0)


def assert_keeps_the_best(score, candidates, chosen):
    """chosen: ascending, among the candidates, and every kept token scores at least as high as every dropped
    one (up to fp32 rounding)."""
    assert (np.diff(chosen) > 0).all() and set(chosen.tolist()) <= set(candidates.tolist())
    kept_scores = score[np.isin(candidates, chosen)]
    dropped = score[~np.isin(candidates, chosen)]
    if len(dropped):
        assert kept_scores.min() >= dropped.max() - 1e-6


def reference_mass_budgets(score, mass, floor, budget, tolerance):
    """The budgets a row may keep under RerankConfig::mass, from fp64 scores: k = the fewest best candidates whose
    scores sum to >= mass of the row's total, clamped to [floor, min(budget, candidates)]. kvsift sums fp32 scores
    (in fixed point), so where the cumulative mass at the boundary lies within `tolerance` of mass, k - 1 (the
    k - 1 best already reach mass - tolerance) or k + 1 (the k best reach less than mass + tolerance) is allowed too,
    nothing further."""
    cumulative = np.cumsum(np.sort(score)[::-1]) / score.sum()
    k = int(np.argmax(cumulative >= mass)) + 1
    ks = {k}
    if k > 1 and cumulative[k - 2] >= mass - tolerance:
        ks.add(k - 1)
    if k < len(score) and cumulative[k - 1] < mass + tolerance:
        ks.add(k + 1)
    return {min(max(j, floor), budget, len(score)) for j in ks}


def propose_and_rerank(cache, lengths, q, rerank):
    """Quest (128 proposals, pages of 16) and the same Quest followed by the rerank stage (selector_config's
    rerank keys `rerank`) over two sequences: both prepared, the lengths grown by the step's token, both run on q
    with o and lse poisoned. Returns the proposals (indices, counts), the rerank's (indices, counts) and its
    (o, lse)."""
    pool = kvsift.ThreadPool(2)

    def make(config):
        return kvsift.DecodeStep("quest", {"budget": 128, "page_size": 16, **config}, q_heads=Q_HEADS,
                                 kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY, max_batch=2,
                                 window=WINDOW, pool=pool)

    proposer, reranked = make({}), make(rerank)
    assert reranked.capacity == rerank["rerank"]
    slots = np.array([0, 1], dtype=np.int32)
    proposer.prepare(cache, slots)
    reranked.prepare(cache, slots)
    lengths += 1
    for step in (proposer, reranked):
        o, lse = poisoned(q.shape, np.float32), poisoned(q.shape[:2], np.float32)
        step.run(q, cache, slots, o=o, lse=lse)
    return proposer.selection(2), reranked.selection(2), (o, lse)


def test_rerank_keeps_the_best_of_the_selectors_proposals_by_the_exact_group_softmax(rng):
    # Quest proposes 128 tokens (8 pages of 16), the rerank keeps 24: the 24 of those proposals with the largest
    # group maximum of each query head's softmax over the proposals, against numpy in fp64.
    k, v, lengths, cache = make_cache(rng, [300, 451])
    kept = 24
    q = rng.standard_normal((2, Q_HEADS, HEAD_DIM)).astype(np.float16)
    (proposals, proposal_counts), (indices, counts), _ = propose_and_rerank(cache, lengths, q, {"rerank": kept})
    for b in range(2):
        for g in range(KV_HEADS):
            candidates = proposals[b, g, :proposal_counts[b, g]]
            assert counts[b, g] == min(kept, len(candidates))
            assert_keeps_the_best(rerank_scores(q, k, b, g, candidates), candidates, indices[b, g, :counts[b, g]])


@pytest.mark.parametrize("kept", [24, 100])
def test_rerank_mass_keeps_the_fewest_best_proposals_holding_the_mass_between_floor_and_budget(rng, kept):
    # selector_config rerank_mass = 0.9, rerank_floor = 2 after Quest's 128 proposals: each row keeps the fewest of
    # its best proposals whose fp64 group-max softmax scores hold 0.9 of the row's total, in [2, kept], against
    # numpy. Sequence 0 (300 tokens) has random queries: spread attention, so rows need ~90 candidates (kept = 24:
    # the budget binds; 100: the rule decides). Sequence 1 (120 tokens: its 100 middle tokens are all proposed)
    # has peaked attention: kv head 0's queries are a scaled key (one token holds nearly all of the mass, the
    # floor decides: 2), kv head 1's queries are three different scaled keys (three tokens of ~1 each: 3).
    k, v, lengths, cache = make_cache(rng, [300, 120])
    mass, floor = 0.9, 2
    q = rng.standard_normal((2, Q_HEADS, HEAD_DIM)).astype(np.float16)
    q[1, :GROUP] = (2 * k[1, 0, 60]).astype(np.float16)
    for h in range(GROUP):
        q[1, GROUP + h] = (2 * k[1, 1, 20 + 30 * h]).astype(np.float16)
    (proposals, proposal_counts), (indices, counts), (o, lse) = propose_and_rerank(
        cache, lengths, q, {"rerank": kept, "rerank_mass": mass, "rerank_floor": floor})
    assert (counts >= floor).all() and (counts <= kept).all()
    assert (counts[1] == [2, 3]).all(), counts
    for b in range(2):
        for g in range(KV_HEADS):
            candidates = proposals[b, g, :proposal_counts[b, g]]
            score = rerank_scores(q, k, b, g, candidates)
            # kvsift's scores are fp32 softmax weights of fp32 logits (64-term dots, |logit| <= ~20): relative
            # errors of a few 1e-6, so the row's cumulative mass is known to 1e-5.
            allowed = reference_mass_budgets(score, mass, floor, kept, tolerance=1e-5)
            assert counts[b, g] in allowed, (b, g, counts[b, g], allowed)
            assert_keeps_the_best(score, candidates, indices[b, g, :counts[b, g]])
    # The attention is over the adaptive selection and the window (o, lse were poisoned).
    for (b, h), (ref_o, ref_lse) in expected_state(q, k, v, lengths, indices, counts, WINDOW).items():
        np.testing.assert_allclose(o[b, h], ref_o, atol=2e-3, rtol=0)
        np.testing.assert_allclose(lse[b, h], ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("config,message", [
    ({"rerank": 24, "rerank_mass": 1.5}, "config.mass (= 1.5) is outside [0, 1]"),
    ({"rerank": 24, "rerank_mass": -0.1}, "config.mass (= -0.1) is outside [0, 1]"),
    ({"rerank": 24, "rerank_mass": "0.9"}, "selector_config['rerank_mass'] (= '0.9') must be a finite number"),
    ({"rerank": 24, "rerank_floor": 0}, "config.floor (= 0) is outside [1, config.budget = 24]"),
    ({"rerank": 24, "rerank_mass": 0.9, "rerank_floor": 25}, "config.floor (= 25) is outside [1, config.budget = 24]"),
    ({"rerank_mass": 0.9}, "selector_config['rerank_mass'] needs selector_config['rerank']"),
    ({"rerank_floor": 2}, "selector_config['rerank_floor'] needs selector_config['rerank']"),
])
def test_rerank_mass_and_floor_are_refused_out_of_range_and_without_rerank(config, message):
    args = dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY)
    with pytest.raises(kvsift.Error) as raised:
        kvsift.DecodeStep("quest", {"budget": 128, **config}, **args)
    assert isinstance(raised.value, ValueError)
    assert message in str(raised.value), f"{message!r} not in {str(raised.value)!r}"


def test_rerank_is_refused_above_the_proposers_capacity_and_for_selectors_without_it():
    args = dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY)
    with pytest.raises(kvsift.Error, match=r"config.budget \(= 200\) exceeds the proposer's capacity \(= 128\)"):
        kvsift.DecodeStep("quest", {"budget": 128, "rerank": 200}, **args)
    with pytest.raises(kvsift.Error, match=r"selector_config has keys .*'rerank'.* that ctkvr does not take"):
        kvsift.DecodeStep("ctkvr", {"budget": 32, "rerank": 16}, **args)
    with pytest.raises(kvsift.Error, match=r"selector_config has keys .*'rerank_mass'.* that ctkvr does not take"):
        kvsift.DecodeStep("ctkvr", {"budget": 32, "rerank_mass": 0.9}, **args)
