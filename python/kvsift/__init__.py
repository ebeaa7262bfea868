"""kvsift from Python: sparse and dense decode, LSE merge, top-k, and the decode step with a selector, on numpy
arrays (CPU) and torch tensors (CPU or CUDA, on torch's current stream), without copies (DLPack).

Storage is float16 or bfloat16 (numpy has no bfloat16: float16 there, either with torch); outputs O are the
storage type or float32, LSE float32 in natural log. Errors of the C++ checks are raised as kvsift.Error (a
ValueError) with the C++ message. Every function takes preallocated outputs (`o`, `lse`, `indices`, ...) and a
`workspace`; left out, they are allocated per call, which an engine's hot path avoids. `import kvsift.torch_ops`
registers them as torch custom ops (torch.ops.kvsift.*) that torch.compile traces and CUDA graphs capture.
docs/python.md is the reference.
"""
import math

import numpy as np

from ._kvsift import Error, KVCache, ThreadPool, has_cuda
from . import _kvsift

__all__ = [
    "Error", "KVCache", "ThreadPool", "has_cuda", "contiguous_cache", "paged_cache", "vllm_cache",
    "vllm_interleaved_cache", "sparse_decode", "dense_decode", "merge_states", "topk_rows", "DecodeStep",
    "SpeContextStep", "to_padded", "from_padded", "positions_to_slots", "lse_to_base2", "lse_from_base2",
]

_ALIGNMENT = 256  # kvsift's workspace alignment (core/workspace.hpp)


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _device(x):
    return "cuda" if _is_torch(x) and x.is_cuda else "cpu"


def _stream(x, stream):
    """The CUDA stream to run on: the given one, else torch's current stream for a CUDA tensor (0 on the CPU)."""
    if stream is not None:
        return int(stream)
    if _is_torch(x) and x.is_cuda:
        import torch
        return torch.cuda.current_stream(x.device).cuda_stream
    return 0


def _cache_stream(cache, stream):
    if stream is not None:
        return int(stream)
    kind, index = cache.device
    if kind == "cuda":
        import torch
        return torch.cuda.current_stream(index).cuda_stream
    return 0


def _dtype_name(x):
    return str(x.dtype).replace("torch.", "")


def _empty(shape, dtype, like):
    """An uninitialized array of `dtype` ('float32', 'float16', 'bfloat16', 'int32', 'uint8') beside `like`."""
    if _is_torch(like):
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if dtype == "bfloat16":
        raise Error("kvsift: numpy has no bfloat16: use float16, or torch tensors")
    return np.empty(shape, dtype=dtype)


def _full(shape, value, dtype, like):
    """An array of `dtype` filled with `value`, beside `like`."""
    if _is_torch(like):
        import torch
        return torch.full(shape, value, dtype=getattr(torch, dtype), device=like.device)
    return np.full(shape, value, dtype=dtype)


def _workspace(nbytes, like):
    """A 256-byte aligned uint8 workspace of nbytes beside `like` (None for 0 bytes)."""
    if nbytes == 0:
        return None
    raw = _empty((nbytes + _ALIGNMENT,), "uint8", like)
    address = raw.data_ptr() if _is_torch(like) else raw.ctypes.data
    skip = -address % _ALIGNMENT
    return raw[skip:skip + nbytes]


def _state(q, heads, o, lse, out_dtype):
    batch, head_dim = q.shape[0], q.shape[-1]
    if o is None:
        o = _empty((batch, heads, head_dim), out_dtype or _dtype_name(q), q)
    if lse is None:
        lse = _empty((batch, heads), "float32", q)
    return o, lse


def _check_arrays(where, **arrays):
    """Refuses, by name, what the bindings would reject without saying why: an argument that is no numpy array
    or torch tensor, and a read-only numpy array (kvsift writes the cache's step token and every output)."""
    for name, x in arrays.items():
        if _is_torch(x):
            continue
        if not isinstance(x, np.ndarray):
            raise Error(f"kvsift.{where}: {name} must be a numpy array or a torch tensor, not {type(x).__name__}")
        if not x.flags.writeable:
            raise Error(f"kvsift.{where}: {name} is a read-only numpy array (flags.writeable is False): pass a "
                        f"writable one, e.g. np.array({name})")


def contiguous_cache(k, v, lengths):
    """K and V [batch, kv_heads, capacity, head_dim] (any strides but the last) and lengths [batch] int32."""
    _check_arrays("contiguous_cache", k=k, v=v, lengths=lengths)
    return KVCache.contiguous(k, v, lengths)


def paged_cache(k_pages, v_pages, page_indptr, page_indices, last_page_len, layout="NHD"):
    """vLLM / FlashInfer pages: NHD [num_pages, page_size, kv_heads, head_dim] or HND [num_pages, kv_heads,
    page_size, head_dim]; sequence b owns page_indices[page_indptr[b]:page_indptr[b + 1]], its last page holding
    last_page_len[b] tokens."""
    _check_arrays("paged_cache", k_pages=k_pages, v_pages=v_pages, page_indptr=page_indptr, page_indices=page_indices,
                  last_page_len=last_page_len)
    return KVCache.paged(k_pages, v_pages, page_indptr, page_indices, last_page_len, layout)


def vllm_cache(key_cache, value_cache, block_tables, seq_lens, layout="NHD"):
    """vLLM's per-layer cache, read in place: key_cache and value_cache NHD [num_blocks, block_size, num_kv_heads,
    head_size] or HND [num_blocks, num_kv_heads, block_size, head_size] (any strides but the last: kv_cache[:, 0] and
    kv_cache[:, 1] of an interleaved one too); block_tables [batch, max_blocks] int32 (C-contiguous), sequence b's
    blocks in order in its row, entries past its ceil(seq_lens[b] / block_size) blocks never read; seq_lens [batch]
    int32, the step's token counted."""
    _check_arrays("vllm_cache", key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                  seq_lens=seq_lens)
    return KVCache.vllm(key_cache, value_cache, block_tables, seq_lens, layout)


def vllm_interleaved_cache(kv_cache, block_tables, seq_lens, layout="NHD"):
    """vLLM's FlashInfer-backend cache, K and V interleaved per block: kv_cache NHD [num_blocks, 2, block_size,
    num_kv_heads, head_size] or HND [num_blocks, 2, num_kv_heads, block_size, head_size], C-contiguous (vLLM's HND
    tensor after its stride order's permute); block_tables and seq_lens as vllm_cache's."""
    _check_arrays("vllm_interleaved_cache", kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    return KVCache.vllm_interleaved(kv_cache, block_tables, seq_lens, layout)


def sparse_decode(q, cache, indices, counts, *, log_weights=None, window=(0, 0), sm_scale=0.0, o=None, lse=None,
                  out_dtype=None, validate=True, pool=None, workspace=None, stream=None):
    """Query heads of q [batch, q_heads, head_dim] attend to the window (sink, recent) and to the selection
    indices [batch, kv_heads, capacity] (int32, the first counts[b, h] of each row; optional natural-log
    log_weights added to the scaled logits). Returns (o, lse).

    validate (default True): every count and index is checked (in the sequence, outside the window, no
    duplicate) and a bad one refused by name before anything is read; an index outside the cache would
    otherwise read outside its memory. On CUDA the check synchronizes the stream and cannot be captured in a
    graph: pass validate=False there, for selections the engine has checked."""
    _check_arrays("sparse_decode", q=q, indices=indices, counts=counts)
    o, lse = _state(q, q.shape[1], o, lse, out_dtype)
    if workspace is None:
        workspace = _workspace(_kvsift.decode_workspace_bytes("sparse", q, cache, indices.shape[-1], tuple(window),
                                                              validate, 0, pool), q)
    _kvsift.sparse_decode(q, cache, indices, counts, o, lse, workspace, log_weights, tuple(window), sm_scale,
                          validate, pool, _stream(q, stream))
    return o, lse


def dense_decode(q, cache, *, sm_scale=0.0, max_seq_len=0, o=None, lse=None, out_dtype=None, pool=None, workspace=None,
                 stream=None):
    """Every query head attends to all tokens of its sequence. Returns (o, lse). max_seq_len: a bound on the
    lengths of a paged cache on CUDA, which sizes the split (0: the pool's token count); unused otherwise."""
    o, lse = _state(q, q.shape[1], o, lse, out_dtype)
    if workspace is None:
        workspace = _workspace(_kvsift.decode_workspace_bytes("dense", q, cache, 0, (0, 0), False, max_seq_len, pool), q)
    _kvsift.dense_decode(q, cache, o, lse, workspace, sm_scale, max_seq_len, pool, _stream(q, stream))
    return o, lse


def merge_states(partials, *, o=None, lse=None, out_dtype=None, stream=None):
    """The LSE merge of partial states [(o_i, lse_i), ...] (float32 partials into float32 or a storage type, or
    a storage type into itself). Returns (o, lse)."""
    if len(partials) == 0:
        raise Error("kvsift.merge_states: partials is empty: it takes at least one (o, lse) pair")
    first = partials[0][0]
    o, lse = _state(first, first.shape[1], o, lse, out_dtype)
    _kvsift.merge_states([(p_o, p_lse) for p_o, p_lse in partials], o, lse, _stream(first, stream))
    return o, lse


def topk_rows(scores, k, *, batch, kv_heads, lengths=None, window=(0, 0), heads_per_row=1, indices=None, counts=None,
              pool=None, workspace=None, stream=None):
    """Per selection row (b, h) the k best of scores [batch * kv_heads * heads_per_row, tokens] (float32) among
    its sequence's first lengths[b] tokens, outside the window, ties to the smaller index; with
    heads_per_row > 1 the union of its score rows' picks. Returns (indices [batch, kv_heads, heads_per_row * k]
    int32 ascending, counts [batch, kv_heads]). lengths None: every sequence has scores.shape[1] tokens."""
    if lengths is None:
        lengths = _full((batch,), scores.shape[1], "int32", scores)
    if indices is None:
        indices = _empty((batch, kv_heads, heads_per_row * k), "int32", scores)
    if counts is None:
        counts = _empty((batch, kv_heads), "int32", scores)
    if workspace is None:
        workspace = _workspace(_kvsift.topk_rows_workspace_bytes(scores.shape[0], scores.shape[1], k, tuple(window),
                                                                 heads_per_row, _device(scores), pool), scores)
    _kvsift.topk_rows(scores, lengths, k, indices, counts, workspace, tuple(window), heads_per_row, pool,
                      _stream(scores, stream))
    return indices, counts


class DecodeStep:
    """One layer's decode step: a selector ('oracle_topk' {budget}, 'quest' {budget, page_size},
    'streaming_llm' {}, 'ctkvr' {budget, list_size, centroids, max_centroids, recalled_centroids, dynamic_update,
    prepare_chunk, budget_fraction, pin_prefill_centroids, max_unindexed}: selectors/ctkvr/ctkvr.hpp's CtkvrConfig;
    'csattention' {budget (tokens, the window's included; 0: keep_fraction of the length), keep_fraction,
    list_fraction, subspaces, centroids, probes, search_period, per_query_head, weight_by_norm, from_floor}:
    selectors/csattention/csattention.hpp's
    CsattentionConfig; 'a2ats' {codebooks (a kvsift_a2ats_codebook file), layer, budget_fraction, max_budget,
    group_max; rope_theta, rope_dim, rope_interleaved: the model's RoPE, which the file's must equal}:
    selectors/a2ats/a2ats.hpp's A2atsConfig, the keys rotated back from the cache; 'centroidkv' {budget_ratio, sinks,
    recent, chunk, r_init, r_step, r_min, interval, max_rounds}: selectors/centroid_kv/centroid_kv.hpp's CentroidKVConfig, a
    merge store of floor(budget_ratio * prompt length) entries attended whole with log-degree weights, window (0, 0);
    'quest', 'csattention' and 'a2ats' also take {rerank, rerank_mass, rerank_floor}: the rerank stage after them
    (selectors/rerank.hpp), which keeps `rerank` tokens of their selection by the exact group softmax, their own
    budget being the proposals'; with rerank_mass = p in (0, 1] (RerankConfig::mass, top-p; 0, the default: off) a
    row keeps the fewest of its best candidates whose scores sum to p of its total, at least rerank_floor (in [1,
    rerank], default 1) and at most rerank, so the selection's counts vary per row; both need rerank),
    then sparse attention of its selection and the window (sink, recent), planned once for
    up to max_batch rows and sequences of up to max_seq_len tokens; the workspace is allocated here, once.

    prepare(cache, slots) indexes the prompts of joining sequences (slot = the sequence's selector state);
    run(q, cache, slots, k=, v=) writes the step's k, v (when given) at position lengths[b] - 1 (the caller has
    grown the lengths), selects and attends, returning (o, lse); release(slots) frees sequences' slots. A slot
    holds a sequence from its prepare to its release (prepared(slot) says whether it does): run on a slot without
    one, and release of one, are refused naming the slot. On CUDA, slots given as a list, a numpy array or left
    out are checked on the host before they are copied to the device; a CUDA tensor of slots is checked with
    validate=True (which synchronizes), else trusted.

    placement (include/kvsift/step/placement.hpp): 'local' (the default: select and attend on `device`), or a split
    over the GPU and the CPU (CUDA builds): 'middle_on_cpu' (the window attended on the GPU, the selected middle on
    the CPU from a pinned host cache, merged on the GPU; every run has max_batch rows) or, with device='cpu',
    'middle_on_gpu' (the selection copied to the GPU, its rows gathered there from the pinned host cache). The
    selector runs on `device`: q, cache and slots are its arrays. A CPU selector's run also takes q_device and
    device_cache (the GPU's query and cache, holding at least the window's rows); a GPU selector's host_cache (pinned
    host memory, e.g. torch's pin_memory(), holding the middle's rows). The engine writes each step's token to every
    cache before run (k, v are refused). o and lse are on the GPU. stats() reports the last run's host times and
    bytes over PCIe. A selector with a second source (centroidkv) runs in 'local' only.

    page_selections=True ('local' only; DecodeStepConfig::page_selections): a selector with page-level selections
    (quest) writes its chosen pages and the attention attends their middle tokens, with no expansion into tokens (a
    launch less per step on CUDA); selection() then lists page ids and selection_page_size is the page size (1
    otherwise)."""

    def __init__(self, selector, config=None, *, q_heads, kv_heads, head_dim, max_seq_len, max_batch=1,
                 max_slots=None, window=(0, 0), sm_scale=0.0, dtype="float16", device="cpu", validate=False,
                 pool=None, placement="local", page_selections=False):
        args = (selector, dict(config or {}), dtype, device)
        shape = (q_heads, kv_heads, head_dim, max_batch, max_seq_len, max_slots or max_batch, tuple(window), sm_scale,
                 validate, pool)
        if page_selections and placement != "local":
            raise Error(f"kvsift.DecodeStep: page_selections applies to placement 'local' (placement = "
                        f"{placement!r}: its CPU and GPU halves exchange tokens)")
        if placement == "local":
            self._step = _kvsift.make_step(*args, *shape, bool(page_selections))
        elif placement in ("middle_on_cpu", "middle_on_gpu"):
            if not _kvsift.has_cuda:
                raise Error(f"kvsift.DecodeStep: placement (= '{placement}') splits the step over the GPU and the "
                            f"CPU, and this kvsift build has no CUDA backend")
            self._step = _kvsift.make_split_step(*args, placement, *shape)
        else:
            raise Error(f"kvsift.DecodeStep: placement (= {placement!r}) must be 'local', 'middle_on_cpu' or "
                        f"'middle_on_gpu'")
        self.selector, self.device, self.dtype, self._kv_heads = selector, device, dtype, kv_heads
        self.placement = placement

    @property
    def capacity(self):
        """Middle tokens a selection row holds at most."""
        return self._step.capacity

    @property
    def selection_page_size(self):
        """What selection() lists: tokens (1), or pages of this many tokens (page_selections=True)."""
        return self._step.selection_page_size if self.placement == "local" else 1

    @property
    def workspace_bytes(self):
        """The workspace the step owns: bytes in its device's memory ('local'), or (device, pinned host) bytes."""
        return self._step.workspace_bytes

    def _local_only(self, what):
        if self.placement != "local":
            raise Error(f"kvsift.DecodeStep.{what}: reported by the 'local' placement only (this step's is "
                        f"'{self.placement}')")

    def prepared(self, slot):
        """Whether `slot` holds a prepared sequence (prepared, not released since)."""
        return self._step.prepared(int(slot))

    def _slots(self, slots, batch, where=None):
        """Rows 0..batch-1 in slots 0..batch-1 unless given (made per call: pass them in a hot path); a list (or
        other sequence) of ints becomes an int32 array on the step's device. `where`: a step's call on a CUDA step,
        whose device slots the C++ step trusts (unless validate=True): slots the host holds are checked here
        against the life cycle first, so that a wild slot is refused rather than read on the device."""
        if slots is None:
            slots = range(batch)
        if _is_torch(slots) and (slots.is_cuda or self.device != "cuda"):
            return slots
        if isinstance(slots, np.ndarray) and self.device != "cuda":
            return slots
        host = [int(s) for s in (slots.tolist() if hasattr(slots, "tolist") else slots)]
        if where is not None and self.device == "cuda":
            for i, s in enumerate(host):
                if not self._step.prepared(s):
                    raise Error(f"kvsift.{where}: slots[{i}] (= {s}) holds no prepared sequence (never prepared, "
                                f"released, or outside the step's slots): prepare it first")
        if self.device == "cuda":
            import torch
            return torch.tensor(host, dtype=torch.int32, device="cuda")
        return np.array(host, dtype=np.int32)

    def prepare(self, cache, slots=None, queries=None, stream=None):
        """queries: the last W prefill queries [batch, q_heads, W, head_dim] (post-RoPE), for selectors that index
        them (ctkvr)."""
        self._step.prepare(cache, self._slots(slots, cache.batch), queries, _cache_stream(cache, stream))

    def run(self, q, cache, slots=None, *, k=None, v=None, q_device=None, device_cache=None, host_cache=None, o=None,
            lse=None, out_dtype=None, stream=None):
        if self.placement == "local":
            if q_device is not None or device_cache is not None or host_cache is not None:
                raise Error("kvsift.DecodeStep.run: q_device, device_cache and host_cache are the split placements'; "
                            "this step's placement is 'local'")
            o, lse = _state(q, q.shape[1], o, lse, out_dtype)
            self._step.run(q, cache, self._slots(slots, q.shape[0], "DecodeStep.run"), o, lse, k, v, _stream(q, stream))
            return o, lse
        if k is not None or v is not None:
            raise Error("kvsift.DecodeStep.run: k and v are refused by a split step, which reads caches the engine has "
                        "written the step's token to")
        gpu_q = q_device if self.device == "cpu" else q
        if gpu_q is None:
            raise Error("kvsift.DecodeStep.run: a CPU selector's split step takes q_device and device_cache (the "
                        "GPU's query and cache)")
        o, lse = _state(gpu_q, q.shape[1], o, lse, out_dtype)
        self._step.run(q, cache, self._slots(slots, q.shape[0], "DecodeStep.run"), o, lse, q_device, device_cache,
                       host_cache, _stream(gpu_q, stream))
        return o, lse

    def stats(self):
        """A split step's last run: select_seconds, cpu_attention_seconds, call_seconds (host times),
        to_host_bytes, to_device_bytes, gathered_kv_bytes (over PCIe)."""
        if self.placement == "local":
            raise Error("kvsift.DecodeStep.stats: the split placements report stats; this step's placement is 'local'")
        return self._step.stats()

    def release(self, slots):
        self._step.release([int(s) for s in slots])

    def union_sizes(self, batch=1):
        """ctkvr: the last run's union of the recalled lists per (sequence, kv head), [batch, kv_heads] int32, before
        the unindexed middle joins it; over list_size * recalled_centroids it is the paper's deduplication
        coefficient. Other selectors raise kvsift.Error. On CUDA this synchronizes the step's stream."""
        self._local_only("union_sizes")
        return np.asarray(self._step.union_sizes(batch), dtype=np.int32).reshape(batch, -1)

    def store_sizes(self):
        """centroidkv: the entries its merge store holds per (slot, kv head), [max_slots, kv_heads] int32. Other
        selectors raise kvsift.Error. On CUDA this synchronizes."""
        self._local_only("store_sizes")
        return np.asarray(self._step.store_sizes(), dtype=np.int32).reshape(-1, self._kv_heads)

    def selection(self, batch=1):
        """The last run's selection as numpy (indices [batch, kv_heads, capacity], counts [batch, kv_heads]);
        on CUDA, synchronize the step's stream first. For evaluation, not the hot path. A split step's is its last
        run's rows (batch is not read)."""
        if self.placement != "local":
            indices, counts = self._step.selection()
            counts = np.asarray(counts, dtype=np.int32).reshape(-1, self._kv_heads)
            return np.asarray(indices, dtype=np.int32).reshape(counts.shape[0], self._kv_heads, -1), counts
        indices, counts = self._step.selection(batch)
        counts = np.asarray(counts, dtype=np.int32).reshape(batch, -1)
        return np.asarray(indices, dtype=np.int32).reshape(batch, counts.shape[1], -1), counts


class SpeContextStep:
    """A model's decode step with SpeContext (selectors/specontext/specontext.hpp, selectors/specontext/step.hpp): once per step,
    before layer 0, the retrieval head's query q_r [batch, q_heads, head_dim] and new key k_r [batch, kv_heads,
    head_dim], both before RoPE, select the `budget` best tokens per (sequence, kv head) (mode 'per_kv_head': each
    group's max softmax weight; 'batch_level': one set per sequence); then every layer attends that one selection
    and the window (sink, recent; recent raised to at least 1, the current token). The head's RoPE: rope_theta,
    rope_dim (0: head_dim), rope_interleaved, and YaRN when yarn_factor is given (over
    yarn_original_max_position_embeddings). sm_scale is the layers', head_sm_scale the head's (0: 1/sqrt(head_dim)).
    The head's keys live in the step (max_slots sequences of up to max_seq_len tokens).

    prepare(cache, k_pre, slots) stores the head's prompt keys k_pre [batch, kv_heads, n, head_dim] (pre-RoPE;
    lengths from cache); select(q, k, cache, slots) appends the step's head key and selects (cache: any layer's,
    whose lengths count the step's token); attend(layer, q, cache, k=, v=) writes the layer's k, v (when given) at
    lengths[b] - 1 and attends, returning (o, lse); selection=(indices, counts) attends that selection instead of
    the last select's (e.g. one kept from an earlier step, see selection()).

    rerank K > 0: each layer keeps the best K of the step's selection by its own exact scores (its group's softmax
    weight over the selection, max over the group) and attends those: build with budget = c x K candidates (e.g.
    c = 4). rerank_mass p > 0 keeps fewer per row (top-p of the exact scores, at least rerank_floor). A selection
    given to attend is reranked as the step's own would be."""

    def __init__(self, *, layers, q_heads, kv_heads, head_dim, max_seq_len, rope_theta, budget=2048,
                 mode="per_kv_head", window=(0, 0), rope_dim=0, rope_interleaved=False, yarn_factor=None,
                 yarn_original_max_position_embeddings=2048, sm_scale=0.0, head_sm_scale=0.0, max_batch=1,
                 max_slots=None, dtype="float16", device="cpu", validate=False, pool=None, rerank=0,
                 rerank_mass=0.0, rerank_floor=1):
        self._step = _kvsift.make_specontext_step(
            dtype, device, layers, q_heads, kv_heads, head_dim, max_seq_len, budget, mode, tuple(window),
            float(rope_theta), rope_dim, bool(rope_interleaved), yarn_factor, yarn_original_max_position_embeddings,
            sm_scale, head_sm_scale, max_batch, max_slots or max_batch, validate, pool, rerank, float(rerank_mass),
            rerank_floor)
        self.device, self.dtype = device, dtype

    @property
    def capacity(self):
        """Middle tokens a selection row holds at most (the budget)."""
        return self._step.capacity

    @property
    def window(self):
        """The (sink, recent) window every layer attends (recent at least 1)."""
        return self._step.window

    @property
    def workspace_bytes(self):
        return self._step.workspace_bytes

    _slots = DecodeStep._slots
    prepared = DecodeStep.prepared

    def prepare(self, cache, k_pre, slots=None, stream=None):
        self._step.prepare(cache, self._slots(slots, cache.batch), k_pre, _cache_stream(cache, stream))

    def select(self, q, k, cache, slots=None, stream=None):
        self._step.select(q, k, cache, self._slots(slots, q.shape[0], "SpeContextStep.select"), _stream(q, stream))

    def attend(self, layer, q, cache, *, k=None, v=None, o=None, lse=None, out_dtype=None, selection=None,
               validate=True, stream=None):
        """selection: (indices, counts) made outside the step, attended instead of the last select's; validate
        (default True) checks it first (counts, range, duplicates, window; on CUDA synchronizing the stream).
        Without it, attend refuses to run before the step's first select (and after prepare or release, until
        the next select)."""
        o, lse = _state(q, q.shape[1], o, lse, out_dtype)
        indices, counts = selection if selection is not None else (None, None)
        self._step.attend(layer, q, cache, o, lse, k, v, indices, counts, validate, _stream(q, stream))
        return o, lse

    def release(self, slots):
        self._step.release([int(s) for s in slots])

    def selection(self, batch=1):
        """The last select's selection as numpy (indices [batch, kv_heads, capacity], counts [batch, kv_heads]);
        on CUDA, synchronize the step's stream first. For evaluation, or to attend it later (attend's selection=)
        after moving it to the step's device."""
        indices, counts = self._step.selection(batch)
        counts = np.asarray(counts, dtype=np.int32).reshape(batch, -1)
        return np.asarray(indices, dtype=np.int32).reshape(batch, counts.shape[1], -1), counts


# ---- engine conventions ------------------------------------------------------------------------------------------

def _arange(n, like):
    if _is_torch(like):
        import torch
        return torch.arange(n, device=like.device)
    return np.arange(n)


def to_padded(indices, counts, width=None):
    """kvsift's (indices [..., capacity], counts [...]) as one int32 array [..., width] padded with -1 past each
    row's count: the form vLLM's and SGLang's sparse paths and FlashMLA take. width defaults to the capacity."""
    xp = _module_of(indices)
    width = indices.shape[-1] if width is None else width
    if bool((counts > width).any()) or bool((counts < 0).any()):
        raise Error(f"kvsift.to_padded: counts must lie in [0, width = {width}] (max {int(counts.max())}, "
                    f"min {int(counts.min())})")
    kept = indices[..., :width]
    if kept.shape[-1] < width:  # a wider form than the capacity: the tail is padding
        pad = xp.zeros(tuple(kept.shape[:-1]) + (width - kept.shape[-1],), dtype=kept.dtype)
        kept = xp.concatenate([kept, pad.to(kept.device) if _is_torch(kept) else pad], -1)
    valid = _arange(width, indices) < counts[..., None]
    return xp.where(valid, kept, xp.full_like(kept, -1))


def from_padded(padded):
    """(indices, counts) of kvsift's form from an int32 array padded with -1 past each row's valid entries;
    refuses a valid entry after a -1."""
    xp = _module_of(padded)
    valid = padded >= 0
    counts = valid.sum(-1)
    if bool((valid != (_arange(padded.shape[-1], padded) < counts[..., None])).any()):
        raise Error("kvsift.from_padded: a row has a valid entry after a -1 (padding must be at the end)")
    indices = xp.where(valid, padded, xp.zeros_like(padded))
    return indices, counts.to(padded.dtype) if _is_torch(padded) else counts.astype(np.int32)


def positions_to_slots(positions, block_table, page_size, seq=None):
    """Token positions of sequences -> slots of a paged pool, as vLLM's slot mapping:
    block_table[seq, pos // page_size] * page_size + pos % page_size. positions [batch, ...] (row b is sequence
    seq[b], default b); -1 entries (padding) stay -1."""
    xp = _module_of(positions)
    batch = positions.shape[0]
    rows = (_arange(batch, positions) if seq is None else seq).reshape((batch,) + (1,) * (positions.ndim - 1))
    valid = positions >= 0
    safe = xp.where(valid, positions, xp.zeros_like(positions))
    blocks = safe // page_size
    if bool((blocks >= block_table.shape[1]).any()):
        raise Error(f"kvsift.positions_to_slots: a position needs block {int(blocks.max())}, the block table has "
                    f"{block_table.shape[1]} per sequence")
    slots = block_table[rows, blocks] * page_size + safe % page_size
    return xp.where(valid, slots, xp.full_like(slots, -1))


_LN2 = math.log(2.0)


def lse_to_base2(lse):
    """Natural-log LSE (kvsift, FlashAttention) -> base 2 (FlashInfer's merge_state)."""
    return lse / _LN2


def lse_from_base2(lse2):
    return lse2 * _LN2


def _module_of(x):
    if _is_torch(x):
        import torch
        return torch
    return np
