"""The package on torch tensors: bfloat16 on the CPU against fp64, and CUDA tensors (torch's current stream)
against the CPU path on the same inputs. Skipped where torch (or a GPU, or kvsift's CUDA backend) is missing."""
import numpy as np
import pytest

import kvsift
from conftest import reference_attention

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kvsift.has_cuda),
                          reason="needs a GPU and kvsift built with CUDA")

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
GROUP = Q_HEADS // KV_HEADS


def random_tensors(seed, batch, capacity, dtype, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, generator=g).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def test_bfloat16_dense_decode_on_cpu_tensors():
    q, k, v = random_tensors(1, 2, 200, torch.bfloat16)
    lengths = torch.tensor([200, 57], dtype=torch.int32)
    o = torch.full((2, Q_HEADS, HEAD_DIM), float("nan"))
    lse = torch.full((2, Q_HEADS), float("nan"))
    kvsift.dense_decode(q, kvsift.contiguous_cache(k, v, lengths), o=o, lse=lse)
    for b in range(2):
        for h in range(Q_HEADS):
            n = int(lengths[b])
            ref_o, ref_lse = reference_attention(q[b, h].float().numpy(), k[b, h // GROUP, :n].float().numpy(),
                                                 v[b, h // GROUP, :n].float().numpy(), HEAD_DIM ** -0.5)
            np.testing.assert_allclose(o[b, h].numpy(), ref_o, atol=2e-3)
            np.testing.assert_allclose(float(lse[b, h]), ref_lse, atol=1e-4)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_decode_merge_topk_agree_with_cpu(dtype):
    batch, capacity, budget = 3, 1000, 96
    q, k, v = random_tensors(2, batch, capacity, dtype)
    lengths = torch.tensor([1000, 611, 129], dtype=torch.int32)
    scores = torch.randn(batch * KV_HEADS * GROUP, capacity, generator=torch.Generator().manual_seed(3))
    results = {}
    for device in ("cpu", "cuda"):
        qd, kd, vd, ld, sd = (t.to(device) for t in (q, k, v, lengths, scores))
        cache = kvsift.contiguous_cache(kd, vd, ld)
        indices, counts = kvsift.topk_rows(sd, budget // GROUP, batch=batch, kv_heads=KV_HEADS, lengths=ld,
                                           window=(4, 32), heads_per_row=GROUP)
        sparse = kvsift.sparse_decode(qd, cache, indices, counts, window=(4, 32), out_dtype="float32")
        dense = kvsift.dense_decode(qd, cache, out_dtype="float32")
        merged = kvsift.merge_states([sparse, dense], out_dtype=str(dtype).replace("torch.", ""))
        torch.cuda.synchronize()
        results[device] = [t.cpu() for t in (indices, counts, *sparse, *dense, *merged)]
    (cpu_indices, cpu_counts), (gpu_indices, gpu_counts) = results["cpu"][:2], results["cuda"][:2]
    assert torch.equal(cpu_counts, gpu_counts)
    for b in range(batch):
        for h in range(KV_HEADS):
            n = int(cpu_counts[b, h])  # entries past the count are not written
            assert torch.equal(cpu_indices[b, h, :n], gpu_indices[b, h, :n]), (b, h)
    for name, cpu, gpu in zip(["sparse o", "sparse lse", "dense o", "dense lse", "merged o", "merged lse"],
                              results["cpu"][2:], results["cuda"][2:]):
        # The CUDA kernel rounds softmax weights to the storage type for P.V (docs/cuda_attention.md).
        torch.testing.assert_close(gpu.float(), cpu.float(), atol=1e-2, rtol=1e-2, msg=name)


@cuda
@pytest.mark.parametrize("selector,config", [("oracle_topk", {"budget": 256}), ("quest", {"budget": 256}),
                                             ("streaming_llm", {})])
def test_cuda_decode_step_on_torch_tensors_agrees_with_cpu(selector, config):
    batch, capacity, prompt = 2, 2048, 1500
    q, k, v = random_tensors(4, batch, capacity, torch.float16)
    steps, caches, lengths, kv = {}, {}, {}, {}
    for device in ("cpu", "cuda"):
        kv[device] = (k.clone().to(device), v.clone().to(device))
        lengths[device] = torch.full((batch,), prompt, dtype=torch.int32, device=device)
        caches[device] = kvsift.contiguous_cache(*kv[device], lengths[device])
        steps[device] = kvsift.DecodeStep(selector, config, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                          max_seq_len=capacity, max_batch=batch, window=(4, 64), device=device,
                                          pool=kvsift.ThreadPool(2) if device == "cpu" else None)
        steps[device].prepare(caches[device])
    g = torch.Generator().manual_seed(5)
    side = torch.cuda.Stream()
    for step_index in range(4):
        new_q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g).half()
        new_k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g).half()
        new_v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g).half()
        out = {}
        for device in ("cpu", "cuda"):
            lengths[device] += 1
            if device == "cuda":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # the step runs on torch's current stream: here a side stream
                    out[device] = steps[device].run(new_q.cuda(), caches[device], k=new_k.cuda(), v=new_v.cuda(),
                                                    out_dtype="float32")
                side.synchronize()
            else:
                out[device] = steps[device].run(new_q, caches[device], k=new_k, v=new_v, out_dtype="float32")
        cpu_indices, cpu_counts = steps["cpu"].selection(batch)
        gpu_indices, gpu_counts = steps["cuda"].selection(batch)
        np.testing.assert_array_equal(gpu_counts, cpu_counts, err_msg=f"step {step_index}")
        for b in range(batch):
            for h in range(KV_HEADS):
                n = cpu_counts[b, h]
                assert sorted(gpu_indices[b, h, :n]) == sorted(cpu_indices[b, h, :n]), (step_index, b, h)
        assert torch.equal(kv["cuda"][0][:, :, prompt + step_index].cpu(), new_k)
        torch.testing.assert_close(out["cuda"][0].cpu(), out["cpu"][0], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(out["cuda"][1].cpu(), out["cpu"][1], atol=1e-3, rtol=1e-4)


@cuda
def test_cuda_refuses_mixed_devices():
    q, k, v = random_tensors(6, 1, 64, torch.float16)
    cache = kvsift.contiguous_cache(k.cuda(), v.cuda(), torch.tensor([64], dtype=torch.int32, device="cuda"))
    with pytest.raises(kvsift.Error, match="one device per call"):
        kvsift.dense_decode(q, cache, o=torch.empty(1, Q_HEADS, HEAD_DIM), lse=torch.empty(1, Q_HEADS))
    step = kvsift.DecodeStep("oracle_topk", {"budget": 8}, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_seq_len=64)
    with pytest.raises(kvsift.Error, match="the step was built for cpu"):
        step.prepare(cache, torch.zeros(1, dtype=torch.int32, device="cuda"))


@cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_paged_dense_decode_agrees_with_cpu(layout):
    page_size, lengths = 16, torch.tensor([300, 17, 64], dtype=torch.int32)
    pages_of = [-(-int(n) // page_size) for n in lengths]
    num_pages = sum(pages_of) + 4
    g = torch.Generator().manual_seed(7)
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    indptr = torch.tensor([0] + list(np.cumsum(pages_of)), dtype=torch.int32)
    last = torch.tensor([int(n) - (p - 1) * page_size for n, p in zip(lengths, pages_of)], dtype=torch.int32)
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM) if layout == "NHD" else (num_pages, KV_HEADS, page_size, HEAD_DIM)
    k_pages, v_pages = torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()
    q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=g).half()
    out = {}
    for device in ("cpu", "cuda"):
        arrays = [t.to(device) for t in (k_pages, v_pages, indptr, order[:int(indptr[-1])].contiguous(), last)]
        cache = kvsift.paged_cache(*arrays, layout=layout)
        out[device] = kvsift.dense_decode(q.to(device), cache, out_dtype="float32")
    torch.cuda.synchronize()
    torch.testing.assert_close(out["cuda"][0].cpu(), out["cpu"][0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out["cuda"][1].cpu(), out["cpu"][1], atol=1e-3, rtol=1e-4)
