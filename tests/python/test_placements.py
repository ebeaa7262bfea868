"""DecodeStep's split placements through the Python package (include/kvsift/step/split_step.hpp): each against the
'local' placement of the same selector on the same data (the same selection, the same attention within fp32
rounding of the merge), torch tensors, the host caches pinned. The refusals run without a GPU."""
import numpy as np
import pytest

import kvsift

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kvsift.has_cuda),
                          reason="needs a GPU and kvsift built with CUDA")

Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY, BATCH = 8, 2, 128, 900, 2
WINDOW = (4, 32)
SHAPE = dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_seq_len=CAPACITY, max_batch=BATCH,
             window=WINDOW)


def problem(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=g).half()
    k = torch.randn(BATCH, KV_HEADS, CAPACITY, HEAD_DIM, generator=g).half()
    v = torch.randn(BATCH, KV_HEADS, CAPACITY, HEAD_DIM, generator=g).half()
    lengths = torch.tensor([CAPACITY, 613], dtype=torch.int32)
    return q, k, v, lengths


def local_run(selector, config, device, q, k, v, lengths):
    step = kvsift.DecodeStep(selector, config, device=device, **SHAPE)
    cache = kvsift.contiguous_cache(k.to(device), v.to(device), lengths.to(device))
    step.prepare(cache)
    o, lse = step.run(q.to(device), cache)
    if device == "cuda":
        torch.cuda.synchronize()
    return step.selection(BATCH), o.cpu(), lse.cpu()


def expect_same(split, local, what):
    (indices, counts), o, lse = split
    (want_indices, want_counts), want_o, want_lse = local
    np.testing.assert_array_equal(counts, want_counts, err_msg=what)
    for b in range(BATCH):
        for g in range(KV_HEADS):
            np.testing.assert_array_equal(indices[b, g, :counts[b, g]], want_indices[b, g, :counts[b, g]], err_msg=what)
    np.testing.assert_allclose(o.float().numpy(), want_o.float().numpy(), atol=4e-3, err_msg=what)
    np.testing.assert_allclose(lse.numpy(), want_lse.numpy(), atol=1e-4, err_msg=what)


@cuda
@pytest.mark.parametrize("selector,config", [("oracle_topk", {"budget": 48}), ("quest", {"budget": 64, "page_size": 16})])
@pytest.mark.parametrize("placement", ["middle_on_cpu", "middle_on_gpu"])
def test_a_cpu_selector_split_equals_the_local_step(selector, config, placement):
    q, k, v, lengths = problem(1)
    local = local_run(selector, config, "cpu", q, k, v, lengths)
    step = kvsift.DecodeStep(selector, config, device="cpu", placement=placement, pool=kvsift.ThreadPool(2), **SHAPE)
    host = kvsift.contiguous_cache(k.pin_memory(), v.pin_memory(), lengths.pin_memory())
    device = kvsift.contiguous_cache(k.cuda(), v.cuda(), lengths.cuda())
    step.prepare(host)
    o, lse = step.run(q, host, q_device=q.cuda(), device_cache=device)
    torch.cuda.synchronize()
    assert o.is_cuda and lse.is_cuda
    expect_same((step.selection(), o.cpu(), lse.cpu()), local, f"{selector} {placement}")
    stats = step.stats()
    assert stats["call_seconds"] >= stats["select_seconds"] > 0
    if placement == "middle_on_gpu":
        assert stats["gathered_kv_bytes"] > 0
    else:
        assert stats["cpu_attention_seconds"] > 0


@cuda
@pytest.mark.parametrize("selector,config", [("oracle_topk", {"budget": 48}), ("quest", {"budget": 64, "page_size": 16})])
def test_a_gpu_selector_middle_on_cpu_equals_the_local_step(selector, config):
    q, k, v, lengths = problem(2)
    local = local_run(selector, config, "cuda", q, k, v, lengths)
    step = kvsift.DecodeStep(selector, config, device="cuda", placement="middle_on_cpu", **SHAPE)
    device = kvsift.contiguous_cache(k.cuda(), v.cuda(), lengths.cuda())
    host = kvsift.contiguous_cache(k.pin_memory(), v.pin_memory(), lengths)
    step.prepare(device)
    o, lse = step.run(q.cuda(), device, host_cache=host)
    torch.cuda.synchronize()
    expect_same((step.selection(), o.cpu(), lse.cpu()), local, f"{selector} on the GPU, middle on the CPU")
    assert step.stats()["to_host_bytes"] > 0


def test_placements_are_refused_by_name():
    with pytest.raises(kvsift.Error, match="placement \\(= 'everywhere'\\) must be 'local', 'middle_on_cpu' or "):
        kvsift.DecodeStep("oracle_topk", {"budget": 8}, placement="everywhere", **SHAPE)
    if not kvsift.has_cuda:
        with pytest.raises(kvsift.Error, match="this kvsift build has no CUDA backend"):
            kvsift.DecodeStep("oracle_topk", {"budget": 8}, placement="middle_on_gpu", **SHAPE)
        return
    with pytest.raises(kvsift.Error, match="a GPU selector's middle on the GPU is 'local'"):
        kvsift.DecodeStep("oracle_topk", {"budget": 8}, device="cuda", placement="middle_on_gpu", **SHAPE)
    with pytest.raises(kvsift.Error, match="has a second source"):
        kvsift.DecodeStep("centroidkv", {"budget_ratio": 0.5}, placement="middle_on_cpu", **dict(SHAPE, window=(0, 0)))
    step = kvsift.DecodeStep("oracle_topk", {"budget": 8}, placement="middle_on_cpu", **SHAPE)
    q, k, v, lengths = problem(3)
    host = kvsift.contiguous_cache(k, v, lengths)
    with pytest.raises(kvsift.Error, match="takes q_device and device_cache"):
        step.run(q, host)
    with pytest.raises(kvsift.Error, match="k and v are refused by a split step"):
        step.run(q, host, k=q, v=q)
    with pytest.raises(kvsift.Error, match="reported by the 'local' placement only"):
        step.union_sizes()
